"""The typed run config against the real registry: every choice and range is checked when composing (so --dry-run
refuses it), the result is frozen, it round-trips through YAML, and each default is defined in one place."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gpo import cli, registry
from gpo.config import CONFIG_ROOT, compose, layer_yaml, to_yaml, validate
from gpo.errors import UserError
from gpo.run_config import SECTIONS, EngineConfig, ModelConfig, RunConfig, as_dict, as_layer

registry.load_builtins()

# (override, the start of the message): choices get the valid names and a suggestion, ranges their bound.
REFUSED = [
    ("algo.loss_agg=foo", "`algo.loss_agg` must be one of seq_mean, token_mean; got `foo`."),
    ("model.dtype=float99", "`model.dtype` must be one of float32, bfloat16, float16; got `float99`. Did you mean"),
    ("optim.schedule=cosin", "`optim.schedule` must be one of cosine, linear, constant; got `cosin`. Did you mean "
                             "`cosine`?"),
    ("algo.kl_estimator=k9", "`algo.kl_estimator` must be one of k1, k2, k3; got `k9`."),
    ("engine.mixed_precision=bf17", "`engine.mixed_precision` must be one of auto, no, bf16, fp16; got `bf17`."),
    ("engine.deepspeed_stage=1", "`engine.deepspeed_stage` must be one of 0, 2, 3; got `1`."),
    ("train.group_size=1", "`train.group_size` must be >= 2, got 1."),
    ("pruner.rate=1.0", "`pruner.rate` must be < 1"),
    ("pruner.rate=-0.1", "`pruner.rate` must be >= 0"),
    ("train.steps=-1", "`train.steps` must be >= 1, got -1."),
    ("train.steps=0", "`train.steps` must be >= 1, got 0."),
    ("optim.lr=0", "`optim.lr` must be > 0"),
    ("train.temperature=0", "`train.temperature` must be > 0"),
    ("train.top_p=1.5", "`train.top_p` must be <= 1"),
    ("optim.betas=[0.9,1.0]", "`optim.betas.1` must be < 1"),
    ("eval.limit=-1", "`eval.limit` must be >= 0, got -1."),
    ("engine.num_processes=0", "`engine.num_processes` must be >= 1, got 0."),
    ("eval.pass_k=[4]", "eval.pass_k holds 4, more than eval.samples=1"),
    ("engine.offload=true", "engine.offload needs DeepSpeed"),
]


@pytest.mark.parametrize("override,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_bad_choice_or_range_is_refused_when_composing(override, message):
    with pytest.raises(UserError) as err:
        compose(["tracker=none", override])
    assert str(err.value).startswith(message), str(err.value)


def test_dry_run_refuses_what_used_to_fail_only_after_loading(capsys):
    # train.steps=-1 used to train zero steps, save a "final" model and exit 0.
    assert cli.main(["run", "--dry-run", "train.steps=-1"]) == 2
    assert "`train.steps` must be >= 1, got -1." in capsys.readouterr().err
    assert cli.main(["run", "--dry-run", "task=gsm8k", "task.data_dir=/no/such/gsm8k"]) == 2
    assert "`task.data_dir`: `/no/such/gsm8k` does not exist" in capsys.readouterr().err


def test_the_run_config_and_every_config_in_it_are_frozen():
    cfg = compose(["tracker=none"])
    assert isinstance(cfg, RunConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 1  # type: ignore[misc]
    for kind in registry.KINDS:
        for entry in registry.entries(kind):
            if not entry.cls.__module__.startswith("gpo."):
                continue  # a test plug-in registered earlier in this process: plug-ins may keep mutable configs
            assert entry.config.__dataclass_params__.frozen, f"{kind} `{entry.name}`: config class is not frozen"
    for name, section in SECTIONS.items():
        assert section.__dataclass_params__.frozen, name


def test_components_read_their_fields_through_the_run_config():
    cfg = compose(["tracker=none", "pruner=topk", "pruner.rate=0.5"])
    assert (cfg.pruner.name, cfg.pruner.rate, cfg.pruner.config.rate) == ("topk", 0.5, 0.5)
    with pytest.raises(AttributeError, match="pruner `topk` has no field `gamma`"):
        cfg.pruner.gamma  # noqa: B018


def test_the_config_round_trips_through_its_yaml_and_as_a_layer(tmp_path: Path):
    cfg = compose(["tracker=none", "algo=dapo", "pruner=random", "pruner.rate=0.25", "train.steps=3",
                   "eval.tasks=[aime24]", "model.lora_rank=4", "run_name=2024"])
    assert cfg.run_name == "2024" and cfg.eval.tasks == ("aime24",)  # numbers in a text field stay text
    assert validate(OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)))) == cfg
    assert compose(layers=[as_layer(cfg)]) == cfg
    path = tmp_path / "run.yaml"
    path.write_text(layer_yaml(cfg))
    assert compose([], [path]) == cfg


def test_building_from_a_mapping_is_checked_like_composing():
    with pytest.raises(UserError, match=r"`pruner.rate` must be < 1"):
        registry.get("pruner", "topk").build({"rate": 1.0})


# --- one place per default ------------------------------------------------------------------------------------


def test_base_yaml_only_picks_components():
    assert set(OmegaConf.load(CONFIG_ROOT / "base.yaml")) == {"defaults"}


def _shipped(kind: str) -> list[Path]:
    return sorted((CONFIG_ROOT / kind).glob("*.yaml"))


@pytest.mark.parametrize("path", [p for kind in [*registry.KINDS, "model", "engine"] for p in _shipped(kind)],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_shipped_yaml_sets_only_values_that_differ_from_the_defaults(path: Path):
    kind, body = path.parent.name, OmegaConf.to_container(OmegaConf.load(path)) or {}
    schema = {"model": ModelConfig, "engine": EngineConfig}.get(kind)
    defaults = as_dict(schema() if schema else registry.get(kind, body.get("name", path.stem)).config())
    repeated = [key for key, value in body.items() if key != "name" and defaults.get(key) == value]
    assert not repeated, f"{path.name} repeats the defaults of {', '.join(repeated)}: they are defined in the class"


def test_a_nested_section_given_in_part_keeps_its_other_defaults():
    cfg = compose(["tracker=none", "task=gsm8k", "task.train.path=other/gsm8k"])
    assert (cfg.task.train.path, cfg.task.train.name) == ("other/gsm8k", "main")  # name: the class's default


def test_a_bad_choice_inside_a_list_names_its_position_and_the_choices():
    with pytest.raises(UserError) as err:
        compose(["tracker=none", "task.operators=[+,/]"])
    assert str(err.value) == "`task.operators.1` must be one of +, -, *; got `/`."


def test_a_typo_inside_a_nested_section_with_a_plain_default_is_refused():
    # task.train's default is a DataSource instance (not a factory): its keys are checked like any section's.
    with pytest.raises(UserError, match=r"unknown key `task.train.pathh`. Did you mean `task.train.path`\?"):
        compose(["tracker=none", "task=gsm8k", "task.train.pathh=x"])
