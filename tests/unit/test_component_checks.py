"""A component's rules across sections live in its config class (`check_run`, gpo.schema): the composer calls it
for every kind once the whole run config is valid, so a plug-in adds one without touching gpo, and gpo/config.py
names no component's field."""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpo import cli, registry
from gpo.config import GROUPS, compose
from gpo.errors import UserError
from gpo.run_config import KINDS, SECTIONS, RunConfig

CONFIG_PY = Path(__file__).resolve().parents[2] / "gpo" / "config.py"
QUICK = ["tracker=none", "backend=hf"]


@dataclass(frozen=True)
class WholeGroupsConfig:
    """A plug-in's setting that must fit in the group, the way selector.n_screen must."""

    at_least: int = 4

    def check_run(self, run: RunConfig) -> None:
        G = run.train.group_size
        if G < self.at_least:
            raise UserError(f"{self.kind}.at_least={self.at_least} is more than train.group_size={G}: raise "
                            f"train.group_size or lower {self.kind}.at_least.")

    @property
    def kind(self) -> str:
        return type(self).__name__.removeprefix("WholeGroups_")


@pytest.fixture
def checked(monkeypatch):
    """A component named `checked` of every kind, registered for this test only, each with `WholeGroupsConfig`."""
    registry.load_builtins()
    monkeypatch.setattr(registry, "_entries", {kind: dict(entries) for kind, entries in registry._entries.items()})
    for kind in KINDS:
        config = dataclass(frozen=True)(type(f"WholeGroups_{kind}", (WholeGroupsConfig,), {}))
        registry.register(kind, "checked", config=config)(type(f"Checked_{kind}", (), {"__doc__": "A plug-in."}))


@pytest.mark.parametrize("kind", KINDS)
def test_a_plugins_check_runs_at_compose_time_for_every_kind(checked, kind):
    with pytest.raises(UserError, match=rf"^{kind}.at_least=4 is more than train.group_size=3: raise "):
        compose([*QUICK, f"{kind}=checked", "train.group_size=3"])
    assert getattr(compose([*QUICK, f"{kind}=checked", "train.group_size=4"]), kind).name == "checked"


def test_a_plugins_refusal_is_one_line_and_exit_code_2_in_a_dry_run(checked, capsys, tmp_path):
    args = ["run", "--dry-run", *QUICK, f"output_dir={tmp_path}", "selector=checked", "selector.at_least=6"]
    assert cli.main([*args, "train.group_size=4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("gpo: error: selector.at_least=6 is more than train.group_size=4: raise "
                                 "train.group_size or lower selector.at_least.\n")
    assert cli.main([*args, "train.group_size=6"]) == 0


# --- gpo/config.py names no component's field ----------------------------------------------------------------------


def component_fields() -> dict[str, set[str]]:
    """Every registered component config's field names, by kind (built-ins and the plug-ins loaded so far)."""
    registry.load_builtins()
    return {kind: {f.name for e in registry.entries(kind) for f in dataclasses.fields(e.config)} for kind in KINDS}


def plain_fields() -> set[str]:
    """Names of RunConfig's own fields, those of its plain sections (`cfg.train`, `cfg.model.path`) and the config
    groups (`experiment=`): config.py reads these, and a component field of the same name is not told apart by name
    alone."""
    return ({f.name for f in dataclasses.fields(RunConfig)} | {f.name for s in SECTIONS.values()
                                                               for f in dataclasses.fields(s)} | set(GROUPS))


def component_field_uses(source: str, fields: dict[str, set[str]]) -> list[str]:
    """Where `source` names a component's field: an attribute read through a component (`cfg.pruner.rate`,
    `x.config.rate`), any other attribute, keyword or string that is a component field's name and no plain
    field's, and a `kind.field` key in any text (messages, OmegaConf paths). Docstrings are documentation, and
    may say what the components' settings do."""
    own = set().union(*fields.values()) - plain_fields()
    keys = re.compile(r"\b(" + "|".join(rf"{kind}\.{name}" for kind, names in fields.items() for name in names)
                      + r")\b")
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        if isinstance(node, ast.Attribute):
            through = node.value.attr if isinstance(node.value, ast.Attribute) else None
            if (through == "config" or through in KINDS) and node.attr not in ("name", "kind", "config"):
                found.append(f"line {line}: .{through}.{node.attr}")
            elif node.attr in own:
                found.append(f"line {line}: .{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg in own:
            found.append(f"line {line}: {node.arg}=")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if node.value in own:
                found.append(f"line {line}: {node.value!r}")
            found += [f"line {line}: {m!r} in text" for m in keys.findall(node.value)]
    return found


def test_the_field_finder_finds_what_config_py_used_to_name():
    fields = component_fields()
    for snippet in ['n = getattr(cfg.selector.config, "n_screen", None)',
                    'ok = hasattr(P, "rate") and hasattr(P, "keep")',
                    'kept_per_group(G, rate=p.rate, keep=p.keep)',
                    'floor = cfg.pruner.min_keep_per_group',
                    'raise UserError(f"selector.n_screen={n} is too large")',
                    'v = OmegaConf.select(prelim, "backend.precision", default="auto")']:
        assert component_field_uses(snippet, fields), snippet
    assert not component_field_uses('G = cfg.train.group_size; b = cfg.backend.name; e = cfg.eval.batch_size',
                                    fields)


def test_config_py_names_no_component_field():
    assert component_field_uses(CONFIG_PY.read_text(), component_fields()) == []
