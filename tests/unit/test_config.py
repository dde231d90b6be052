"""The config composer: layer order, group picks, plug-ins, and the errors a user sees for bad input.

The first half runs against a small config tree of its own (stub components in a throw-away registry), so it
tests the composer, not today's YAML. The second half runs over the real `configs/` tree and registry, so every
option a user can pick is composed and validated, and new YAML files are covered the moment they are added.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gpo import config, registry
from gpo.config import compose
from gpo.errors import UserError
from gpo.registry import register
from gpo.run_config import as_dict
from kit import HANG_S, REPO, fresh_registry, make_plugin  # noqa: F401  (fresh_registry is a fixture)

# --- a config tree of our own ----------------------------------------------------------------------------------


@dataclass
class StubConfig:
    rate: float = 0.1
    scope: str = "group"
    n: int | None = None


TREE = {
    "base.yaml": """
        defaults: {algo: a, selector: q, pruner: p1, allocator: s, task: t, backend: b, correction: c, tracker: n,
                   model: m, engine: e}
        train: {steps: 30}
    """,
    "pruner/p1.yaml": "name: p1\nrate: 0.25\n",
    "pruner/p2.yaml": "rate: 0.5\n",  # no `name:`: the file name is the component's name
    "model/m.yaml": "path: tiny\n",
    "engine/e.yaml": "",  # an empty file is an empty mapping
    "experiment/exp.yaml": """
        defaults: {pruner: p2}
        train: {steps: 5}
        optim: {lr: 2.0e-6}
        pruner: {rate: 0.75}
    """,
}


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry) -> Path:  # noqa: F811 (the fixture)
    """configs/ of TREE, with components a, q, p1, p2, p3 (a plug-in without YAML), s, t, b, c, n registered."""
    for rel, text in TREE.items():
        path = tmp_path / "configs" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(line.strip() for line in text.splitlines()))
    monkeypatch.setattr(config, "CONFIG_ROOT", tmp_path / "configs")
    for kind, name in [("algo", "a"), ("selector", "q"), ("pruner", "p1"), ("pruner", "p2"), ("pruner", "p3"),
                       ("allocator", "s"), ("task", "t"), ("backend", "b"), ("correction", "c"), ("tracker", "n")]:
        register(kind, name, config=StubConfig)(type(f"Stub_{kind}_{name}", (), {"__doc__": "A stub."}))
    return tmp_path


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_base_alone_takes_its_defaults_and_the_picked_files(tree):
    cfg = compose([])
    assert as_dict(cfg.pruner) == {"name": "p1", "rate": 0.25, "scope": "group", "n": None}
    assert cfg.train.steps == 30  # base.yaml
    assert cfg.train.group_size == 8  # TrainConfig's default, base.yaml does not set it
    assert cfg.model.path == "tiny"  # model/m.yaml
    assert set(as_dict(cfg)) == {"seed", "plugins", "output_dir", "run_name", "resume", "model", "train", "optim",
                        "eval", "checkpoint", "engine", "algo", "selector", "pruner", "allocator", "task", "backend",
                        "correction", "tracker"}


def test_a_pick_replaces_the_default_and_a_file_without_name_is_named_after_itself(tree):
    cfg = compose(["pruner=p2"])
    assert (cfg.pruner.name, cfg.pruner.rate) == ("p2", 0.5)


def test_a_registered_component_without_a_yaml_file_can_be_picked(tree):
    cfg = compose(["pruner=p3"])
    assert (cfg.pruner.name, cfg.pruner.rate) == ("p3", 0.1)  # the dataclass default


def test_layer_order_base_pick_experiment_config_file_override(tree):
    # train.steps: base 30 -> experiment 5 -> --config 7 -> override 9; each later layer wins.
    assert compose(["experiment=exp"]).train.steps == 5
    one = _write(tree / "one.yaml", "train: {steps: 7}\n")
    assert compose(["experiment=exp"], [one]).train.steps == 7
    assert compose(["experiment=exp", "train.steps=9"], [one]).train.steps == 9
    two = _write(tree / "two.yaml", "train: {steps: 8}\n")
    assert compose([], [one, two]).train.steps == 8  # two --config files: the later wins


def test_an_experiment_picks_through_defaults_and_its_values_beat_the_picked_file(tree):
    cfg = compose(["experiment=exp"])
    assert cfg.pruner.name == "p2"  # experiment's `defaults:` beats base.yaml's p1
    assert cfg.pruner.rate == 0.75  # experiment's pruner section beats p2.yaml's 0.5
    assert cfg.optim.lr == 2.0e-6
    assert cfg.train.steps == 5


def test_command_line_picks_beat_experiment_and_config_file_defaults(tree):
    picks_p3 = _write(tree / "p3.yaml", "defaults: {pruner: p3}\n")
    assert compose(["experiment=exp"], [picks_p3]).pruner.name == "p3"  # --config's defaults beat experiment's
    assert compose(["experiment=exp", "pruner=p1"], [picks_p3]).pruner.name == "p1"  # the command line beats both


def test_values_take_their_schema_types(tree):
    cfg = compose(["pruner.rate=1", "optim.lr=1e-6", "train.steps=3"])
    # `1` parses as an int and becomes the float 1.0 its schema asks for; `1e-6` parses as a float.
    assert type(cfg.pruner.rate) is float and cfg.pruner.rate == 1.0
    assert type(cfg.optim.lr) is float and cfg.optim.lr == 1e-6
    assert type(cfg.train.steps) is int and cfg.train.steps == 3
    assert cfg.pruner.config == StubConfig(rate=1.0)
    train = cfg.train
    assert isinstance(train, config.TrainConfig) and (train.steps, train.group_size) == (3, 8)


def test_model_given_as_a_path_or_hub_name_sets_model_path(tree):
    assert compose(["model=Qwen/Qwen2.5-0.5B-Instruct"]).model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert compose(["model=m"]).model.path == "tiny"  # a shipped model config is still a pick


def test_plugins_key_imports_a_module_before_picks_resolve(tree, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(make_plugin(tmp_path / "plug", "gpo_test_cfg_plugin", "halves", False)))
    cfg = compose(["plugins=[gpo_test_cfg_plugin]", "pruner=halves", "pruner.offset=1"])
    assert as_dict(cfg.pruner) == {"name": "halves", "offset": 1}
    assert list(cfg.plugins) == ["gpo_test_cfg_plugin"]


# --- errors ------------------------------------------------------------------------------------------------------


def _error(args: list[str], files: list[str] = ()) -> str:
    with pytest.raises(UserError) as err:
        compose(args, files)
    return str(err.value)


def test_an_unknown_key_names_its_path_and_the_closest_valid_key(tree):
    msg = _error(["optim.lrr=1"])
    assert msg.startswith("unknown key `optim.lrr`. Did you mean `optim.lr`? Valid keys: optim.betas, optim.eps,")
    assert _error(["trian.steps=3"]).startswith("unknown key `trian`. Did you mean `train`?")
    assert _error(["pruner.rat=0.5"]).startswith("unknown key `pruner.rat`. Did you mean `pruner.rate`?")


def test_an_unknown_key_inside_a_config_file_is_found_at_depth(tree):
    bad = _write(tree / "bad.yaml", "model:\n  pathh: x\n")
    assert _error([], [bad]).startswith("unknown key `model.pathh`. Did you mean `model.path`?")


def test_a_wrong_type_names_the_key_the_value_and_the_expected_type(tree):
    assert _error(["train.steps=abc"]) == "`train.steps` has the wrong type: expected int, got 'abc'."
    assert _error(["train.steps=1.5"]) == "`train.steps` has the wrong type: expected int, got 1.5."
    assert _error(["pruner.rate=abc"]) == "`pruner.rate` has the wrong type: expected float, got 'abc'."
    assert _error(["pruner.n=x"]) == "`pruner.n` has the wrong type: expected int | None, got 'x'."
    assert _error(["optim.betas=3"]) == "`optim.betas` has the wrong type: expected list[float], got 3."


def test_a_wrong_enum_value_lists_the_choices():
    # Against the real registry: the topk pruner's `scope` is an Enum of three scopes.
    assert _error(["pruner=topk", "pruner.scope=grup"]) == (
        "`pruner.scope` must be one of group, rank, global; got `grup`. Did you mean `group`?"
    )


def test_a_value_where_a_section_belongs_says_so(tree):
    assert _error(["train=3"]).startswith("`train` is a section, not a value (got 3); set its keys instead")
    scalar = _write(tree / "scalar.yaml", "pruner: 3\n")
    assert _error([], [scalar]).startswith("`pruner` must be a section with a `name`, got 3")


def test_a_missing_config_file_is_named(tree):
    missing = tree / "nowhere" / "run.yaml"
    assert _error([], [str(missing)]) == f"--config file `{missing}` does not exist."


def test_a_config_file_that_is_not_a_mapping_or_not_yaml(tree):
    assert _error([], [_write(tree / "list.yaml", "- a\n- b\n")]).endswith("must hold a mapping at the top level.")
    assert _error([], [_write(tree / "broken.yaml", "train: [1,\n")]).startswith("cannot read YAML")


def test_an_unknown_pick_lists_the_valid_choices(tree):
    # Choices are the YAML files (p1, p2) plus registered components without one (p3).
    assert _error(["pruner=nope"]) == "unknown pruner `nope`. Valid choices: p1, p2, p3."
    assert _error(["experiment=exq"]) == "unknown experiment `exq`. Valid choices: exp. Did you mean `exp`?"
    assert _error(["model=mm"]) == "unknown model `mm`. Valid choices: m. Did you mean `m`?"


def test_a_component_group_without_a_pick_asks_for_one(tree):
    (tree / "configs" / "base.yaml").write_text(
        "defaults: {algo: a, selector: q, pruner: p1, allocator: s, backend: b, tracker: n}")
    assert _error([]).startswith("`task` is missing: pick one with `task=NAME` (choices: t)")


def test_arguments_that_are_neither_picks_nor_overrides(tree):
    assert _error(["train.steps"]).startswith("cannot read `train.steps`")
    assert _error(["seed=[1"]).startswith("cannot parse overrides seed=[1")


# --- the real configs/ tree ------------------------------------------------------------------------------------

FOLDERS = {"algo": "algorithms", "pruner": "pruners", "allocator": "allocators", "task": "tasks"}
YAML_FILES = sorted(p.relative_to(REPO / "configs") for p in (REPO / "configs").glob("*/*.yaml"))


def _builtin(kind: str) -> set[str]:
    registry.load_builtins()
    return {e.name for e in registry.entries(kind) if e.cls.__module__.startswith("gpo.")}


@pytest.mark.parametrize("rel", YAML_FILES, ids=str)
def test_every_option_of_every_group_composes_and_validates(rel: Path):
    group, name = rel.parent.name, rel.stem
    if set(OmegaConf.load(REPO / "configs" / rel)) & {"grid", "baseline", "study"}:  # a study's experiment:
        from gpo.study import plan  # every run of its grid composes and validates, through `gpo study`

        assert plan([f"{group}={name}"]).runs
        return
    cfg = compose([f"{group}={name}"])
    if group in registry.KINDS:
        assert getattr(cfg, group).name == name
        assert OmegaConf.load(REPO / "configs" / rel).get("name", name) == name  # `name:` agrees with the file


@pytest.mark.parametrize("kind", registry.KINDS)
def test_config_files_and_registry_names_agree(kind: str):
    files = {p.stem for p in (REPO / "configs" / kind).glob("*.yaml")}
    assert files == _builtin(kind), "each registered component ships configs/<kind>/<name>.yaml and vice versa"


@pytest.mark.parametrize("kind", sorted(FOLDERS))
def test_each_component_lives_in_the_module_named_after_it(kind: str):
    registry.load_builtins()
    for name in _builtin(kind):
        module = registry.get(kind, name).cls.__module__
        assert module == f"gpo.{FOLDERS[kind]}.{name}", f"{kind} `{name}` is defined in {module}"
        assert (REPO / FOLDERS[kind] / f"{name}.py").is_file()


HEAVY = ("transformers", "datasets", "mlflow", "vllm", "deepspeed", "math_verify")


def test_composing_imports_nothing_heavy():
    # In a fresh interpreter: compose() imports every built-in component module (load_builtins), so a heavy
    # top-level import anywhere in a component shows up here.
    code = (
        "import sys\n"
        "from gpo.config import compose\n"
        "compose(['experiment=cppo_gsm8k'])\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"heavy modules imported while composing a config: {out.stdout.strip()}"
