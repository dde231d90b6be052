"""Compose a run's config from YAML groups and validate it into one frozen, typed `RunConfig`.

Order of layers, later wins (Hydra-style, but a few hundred lines of our own on OmegaConf):
    configs/base.yaml  ->  configs/<group>/<name>.yaml for each group pick (algo=dapo, task=math, ...)
    ->  experiment=NAME (configs/experiment/NAME.yaml)  ->  --config FILE.yaml  ->  in-memory layers (a study's)
    ->  dotted overrides (optim.lr=1e-6)
`base.yaml`, an experiment and a --config file may carry a `defaults:` mapping of group picks; command-line picks
win over all of them. The merged mapping is then checked against the dataclasses of gpo/run_config.py (component
sections against the registered component's config class) by pydantic: an unknown key, a wrong type, a choice that
does not exist or a value out of its range fails here, naming the full key path and the closest valid key or
choice, before any model or dataset is touched. Defaults live in those dataclasses only.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import typing
from collections.abc import Mapping, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from gpo import registry
from gpo.errors import UserError, did_you_mean
from gpo.run_config import (
    COMPONENT_KINDS,
    SECTIONS,
    CheckpointConfig,
    Component,
    EngineConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    StudyConfig,
    TrainConfig,
    as_dict,
    as_layer,
)

__all__ = ["CheckpointConfig", "EngineConfig", "EvalConfig", "ModelConfig", "OptimConfig", "RunConfig",
           "StudyConfig", "TrainConfig", "as_layer", "choices", "compose", "split_args", "to_yaml", "validate",
           "validated"]

CONFIG_ROOT = Path(str(files("gpo.configs")))
COMPONENT_GROUPS = COMPONENT_KINDS
PLAIN_GROUPS = ("model", "engine")
GROUPS = COMPONENT_GROUPS + PLAIN_GROUPS + ("experiment",)
AUTO_BACKEND = "auto"  # not a component: compose() replaces it by gpo.backends.pick_auto's choice
STUDY_KEYS = ("grid", "baseline", "study")  # a study's own top-level keys; gpo.study takes them out before composing
TOP_LEVEL = tuple(f.name for f in dataclasses.fields(RunConfig)
                  if f.name not in SECTIONS and f.name not in COMPONENT_KINDS)


# --- command line ---------------------------------------------------------------------------------------------


def split_args(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """`algo=dapo` (no dot, a group name) is a group pick; every other `key=value` is a dotted override."""
    picks: dict[str, str] = {}
    overrides: list[str] = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise UserError(f"cannot read `{arg}`: arguments are `group=name` picks or `key=value` overrides.")
        if key == "model" and value not in choices("model") and _looks_like_model_path(value):
            overrides.append(f"model.path={value}")  # `model=Qwen/Qwen2.5-0.5B-Instruct` or a local path
        elif key in GROUPS:
            picks[key] = value
        else:
            overrides.append(arg)
    return picks, overrides


# --- composition ----------------------------------------------------------------------------------------------


def _completion_length(prelim: DictConfig) -> int:
    """train.max_completion_length as the layers set it (the default where none does), for backend=auto; a value
    that is not a positive integer counts as the default here and is refused by validation afterwards."""
    value = OmegaConf.select(prelim, "train.max_completion_length", default=None)
    default = TrainConfig.max_completion_length
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def compose(args: Sequence[str] = (), config_files: Sequence[str | Path] = (),
            layers: Sequence[Mapping[str, Any]] = ()) -> RunConfig:
    """Build and validate the run config from command-line style arguments, files and in-memory layers."""
    picks, overrides = split_args(list(args))
    base = _load_yaml(CONFIG_ROOT / "base.yaml")
    picked: dict[str, str] = dict(base.pop("defaults", {}))

    stack = []
    if "experiment" in picks:
        stack.append(_load_yaml(_group_file("experiment", picks.pop("experiment"))))
    stack += [_load_yaml(_user_file(p)) for p in config_files]
    stack += [_as_node(layer, "a config layer") for layer in layers]
    for layer in stack:
        picked.update(layer.pop("defaults", None) or {})
    picked.update(picks)
    try:
        override_layer = OmegaConf.from_dotlist(overrides)
    except Exception as exc:
        raise UserError(f"cannot parse overrides {' '.join(overrides)}: {exc}") from exc

    # Plug-ins must be imported before group picks are resolved: they may bring components without YAML files.
    registry.load_builtins()
    prelim = cast(DictConfig, OmegaConf.merge(base, *stack, override_layer))  # mappings merge into a mapping
    registry.load_plugins(_as_list(prelim.get("plugins")))
    auto_note = None
    if picked.get("backend") == AUTO_BACKEND:
        from gpo.backends import pick_auto

        picked["backend"], why = pick_auto(_completion_length(prelim))
        auto_note = f"backend=auto picked `{picked['backend']}`: {why}."

    groups = OmegaConf.create({group: _group_node(group, name) for group, name in picked.items()})
    merged = OmegaConf.merge(base, groups, *stack, override_layer)
    try:
        plain = cast(dict[str, Any], OmegaConf.to_container(merged, resolve=True))
    except Exception as exc:  # an interpolation `${...}` that points nowhere
        raise UserError(f"cannot resolve the config: {exc}") from None
    cfg = validate(plain)
    if auto_note:  # only for a valid config: an error message stays the one line it is
        _say_once(auto_note)
    return cfg


def validate(raw: Mapping[str, Any]) -> RunConfig:
    """A plain mapping (every layer merged) as the typed run config, or a UserError naming the first problem.
    The built-in components and the mapping's `plugins` are imported first (a fresh process can validate a saved
    config)."""
    raw = dict(_plain(raw))
    registry.load_builtins()
    registry.load_plugins(_as_list(raw.get("plugins")))
    top = set(TOP_LEVEL) | set(SECTIONS) | set(COMPONENT_KINDS)
    for key in raw:
        if key in STUDY_KEYS:
            raise UserError(f"`{key}` is read by `gpo study` (a grid of runs), not by a single run: run this "
                            "experiment or file with `gpo study`.")
        if key not in top:
            raise UserError(f"unknown key `{key}`." + did_you_mean(str(key), top) + _valid_keys_hint(top))
    values: dict[str, Any] = {}
    for kind in COMPONENT_KINDS:
        values[kind] = _component(kind, raw.get(kind))
    for name, schema in SECTIONS.items():
        node = raw.get(name)
        if node is not None and not isinstance(node, Mapping):
            raise UserError(_not_a_section(name, node, schema))
        values[name] = validated(node or {}, schema, name)
    cfg = validated({k: raw[k] for k in TOP_LEVEL if k in raw}, _TopLevel, "")
    cfg = RunConfig(**values, **{k: getattr(cfg, k) for k in TOP_LEVEL})
    _check_together(cfg)
    return cfg


def validated(node: Mapping[str, Any], schema: type, path: str) -> Any:
    """`node` as an instance of the dataclass `schema`: unknown keys, wrong types, choices and ranges are
    UserErrors with the full key path (`path` is the section's own, e.g. "train" or "pruner")."""
    node = _plain(node)
    _check_keys(node, schema, path)
    node = _over_defaults(_numbers_as_text(node, schema), schema)
    from pydantic import ValidationError

    try:
        adapter = _adapter(schema)
    except Exception:  # a plug-in annotation pydantic cannot read: the dataclass's own constructor decides
        try:
            return schema(**node)
        except TypeError as exc:
            raise UserError(f"`{path}`: {exc}.") from None
    try:
        return adapter.validate_python(node)
    except ValidationError as exc:
        raise UserError(_explain(exc.errors()[0], schema, path)) from None


def component(kind: str, name: str, **values: Any) -> Component:
    """One component as a run would get it from `kind=name`: its shipped YAML (if any) with `values` over it."""
    node = _plain(_group_node(kind, name))
    return _component(kind, {**node, **values})


def choices(group: str) -> list[str]:
    """Names a group pick may take: its YAML files, plus registered components that ship none (plug-ins)."""
    folder = CONFIG_ROOT / group
    found = {p.stem for p in folder.glob("*.yaml")} if folder.is_dir() else set()
    if group in COMPONENT_GROUPS:
        found |= set(registry.names(group))
    if group == "backend":
        found.add(AUTO_BACKEND)
    return sorted(found)


def to_yaml(cfg: RunConfig) -> str:
    """The config as YAML (`--dry-run`, each run's config.yaml); composing it as a layer gives `cfg` back."""
    return OmegaConf.to_yaml(OmegaConf.create(as_dict(cfg)))


def layer_yaml(cfg: RunConfig) -> str:
    """The config as a `--config` file that picks the same components (`defaults:`) and sets every value."""
    return OmegaConf.to_yaml(OmegaConf.create(as_layer(cfg)))


# --- validation helpers -------------------------------------------------------------------------------------


def _top_level_schema() -> type:
    """RunConfig's own scalar fields (seed, plugins, ...) as a dataclass, validated like a section; their types and
    defaults are read from RunConfig, so they are defined there only."""
    hints = typing.get_type_hints(RunConfig, include_extras=True)
    fields = [(f.name, hints[f.name], dataclasses.field(default=f.default))
              for f in dataclasses.fields(RunConfig) if f.name in TOP_LEVEL]
    return dataclasses.make_dataclass("RunConfigTopLevel", fields, frozen=True)


_TopLevel = _top_level_schema()


def _component(kind: str, node: Any) -> Component:
    if node is not None and not isinstance(node, Mapping):
        raise UserError(f"`{kind}` must be a section with a `name`, got {node!r}; pick a component with "
                        f"`{kind}=NAME` (choices: {', '.join(choices(kind))}).")
    if node is None or "name" not in node:
        raise UserError(f"`{kind}` is missing: pick one with `{kind}=NAME` (choices: {', '.join(choices(kind))}).")
    entry = registry.get(kind, str(node["name"]))
    body = {k: v for k, v in node.items() if k != "name"}
    return Component(kind, entry.name, validated(body, entry.config, kind))


def _check_together(cfg: RunConfig) -> None:
    """Rules that involve two fields, or the registry."""
    E = cfg.eval
    too_big = [k for k in E.pass_k if k > E.samples]
    if too_big:
        raise UserError(f"eval.pass_k holds {too_big[0]}, more than eval.samples={E.samples}: pass@k needs at least "
                        f"k samples per question (raise eval.samples or drop that k).")
    if cfg.engine.offload and cfg.engine.deepspeed_stage == 0:
        raise UserError("engine.offload needs DeepSpeed: set engine.deepspeed_stage=2 or 3 (engine=zero2 / zero3).")
    for name in E.tasks:  # scored at the end of the run: a typo must fail now, not after training
        registry.get("task", str(name))


@functools.cache
def _adapter(schema: type) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(schema)


def _explain(error: Mapping[str, Any], schema: type, path: str) -> str:
    """One pydantic error as a sentence about the user's key."""
    loc = [str(p) for p in error["loc"]]
    key = _join(path, ".".join(loc))
    value = error.get("input")
    kind, ctx = error["type"], error.get("ctx") or {}
    options = _choices_at(schema, loc)
    if options is not None and kind in ("literal_error", "enum"):
        shown = [str(o) for o in options]
        return (f"`{key}` must be one of {', '.join(shown)}; got `{value}`." + did_you_mean(str(value), shown))
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        bound = next(iter(ctx.values()))
        return f"`{key}` must be {bounds[kind]} {bound}, got {value!r}." + _range_hint(schema, loc)
    if kind == "missing":
        return f"`{key}` is required and has no default: set it (`{key}=...`)."
    if kind == "value_error":  # a field's own validator (e.g. a directory that must exist) says what is wrong
        return f"`{key}`: {str(ctx.get('error') or error['msg']).removeprefix('Value error, ')}"
    expected = _type_name(schema, loc)
    return f"`{key}` has the wrong type: expected {expected}, got {value!r}."


def _range_hint(schema: type, loc: list[str]) -> str:
    hint = _hint_at(schema, loc)
    bounds = [m for m in getattr(hint, "__metadata__", ()) if type(m).__module__.startswith("annotated_types")]
    if len(bounds) < 2:
        return ""
    text = {"Ge": ">=", "Gt": ">", "Le": "<=", "Lt": "<"}
    # annotated_types bounds are slotted dataclasses (no __dict__): read their one field by name
    parts = [f"{text.get(type(b).__name__, type(b).__name__)} {getattr(b, dataclasses.fields(b)[0].name)}"
             for b in bounds]
    return f" Valid: {' and '.join(parts)}."


def _hint_at(schema: Any, loc: list[str]) -> Any:
    """The annotation at a pydantic error location: field names in dataclasses, indices in tuples."""
    hint = schema
    for part in loc:
        core = _core(hint)
        if part.isdigit() and typing.get_origin(core) in (tuple, list):
            args = [a for a in typing.get_args(core) if a is not Ellipsis]
            hint = args[0] if len(args) == 1 else (args[int(part)] if int(part) < len(args) else None)
        elif isinstance(core, type) and dataclasses.is_dataclass(core):
            hint = _hints(core).get(part)
        else:
            return None
    return hint


def _core(hint: Any) -> Any:
    """Annotated[X, ...] -> X; X | None -> X (the type a value of the field has when it is set)."""
    options = [h for h in _flatten_hint(hint) if h is not type(None)]
    return options[0] if len(options) == 1 else hint


def _choices_at(schema: type, loc: list[str]) -> list[Any] | None:
    hint = _hint_at(schema, loc)
    for arg in _flatten_hint(hint):
        if typing.get_origin(arg) is typing.Literal:
            return list(typing.get_args(arg))
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return [m.value for m in arg]
    return None


def _type_name(schema: type, loc: list[str]) -> str:
    hint = _hint_at(schema, loc)
    if hint is None:
        return "a valid value"
    return " | ".join(_type_text(h) for h in _flatten_hint(hint))


def _type_text(hint: Any) -> str:
    """How a user writes the type in YAML: sequences are lists (tuple[float, ...] and tuple[float, float] are
    `list[float]`), bounds are left to the range message."""
    if hint is type(None):
        return "None"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (tuple, list):
        items = sorted({" | ".join(_type_text(h) for h in _flatten_hint(a)) for a in args if a is not Ellipsis})
        return f"list[{' | '.join(items)}]" if items else "list"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    return getattr(hint, "__name__", str(hint))


def _flatten_hint(hint: Any) -> list[Any]:
    """Annotated[X, ...] -> [X]; X | None -> [X, NoneType]; anything else -> [hint]."""
    if typing.get_origin(hint) is typing.Annotated:
        return _flatten_hint(typing.get_args(hint)[0])
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return [h for arg in typing.get_args(hint) for h in _flatten_hint(arg)]
    return [hint]


@functools.cache
def _hints(schema: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(schema, include_extras=True)
    except Exception:  # an annotation that cannot be resolved: fall back to the fields' own (string) types
        return {f.name: f.type for f in dataclasses.fields(schema)}


def _numbers_as_text(node: Mapping[str, Any], schema: type) -> dict[str, Any]:
    """`run_name=2024` or `eval.split=1` parse as numbers on the command line; a text field takes them as text."""
    out = dict(node)
    for key, value in node.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            options = _flatten_hint(_hints(schema).get(key))
            if str in options and not ({int, float} & set(options)):
                out[key] = str(value)
    return out


def _over_defaults(node: dict[str, Any], schema: type) -> dict[str, Any]:
    """A nested section given in part (`task.train.path=...`) keeps the field's other defaults: the mapping is laid
    over the field's default dataclass, as a YAML layer would be."""
    out = dict(node)
    for f in dataclasses.fields(schema):
        value = node.get(f.name)
        default = registry.field_default(f)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(default) and not isinstance(default, type):
            out[f.name] = {**as_dict(default), **_over_defaults(dict(value), type(default))}
    return out


def _check_keys(node: Any, schema: type, path: str) -> None:
    if not isinstance(node, Mapping):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        full = _join(path, str(key))
        if key not in fields:
            valid = [_join(path, f) for f in fields]
            raise UserError(f"unknown key `{full}`." + did_you_mean(full, valid) + _valid_keys_hint(valid))
        sub = _dataclass_of(fields[key])
        if sub is not None and node[key] is not None:
            if not isinstance(node[key], Mapping):
                raise UserError(_not_a_section(full, node[key], sub))
            _check_keys(node[key], sub, full)


def _not_a_section(full: str, value: Any, schema: type) -> str:
    sub_keys = [_join(full, f.name) for f in dataclasses.fields(schema)]
    return (f"`{full}` is a section, not a value (got {value!r}); set its keys instead, e.g. `{sub_keys[0]}=...`."
            + _valid_keys_hint(sub_keys))


def _dataclass_of(f: dataclasses.Field) -> type | None:
    default = registry.field_default(f)
    return type(default) if dataclasses.is_dataclass(default) and not isinstance(default, type) else None


def _as_node(layer: Mapping[str, Any], what: str) -> DictConfig:
    node = OmegaConf.create(dict(layer))
    if not isinstance(node, DictConfig):
        raise UserError(f"{what} must be a mapping.")
    return node


# --- helpers ----------------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _valid_keys_hint(valid: Any) -> str:
    return f" Valid keys: {', '.join(sorted(valid))}."


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_said: set[str] = set()


def _say_once(message: str) -> None:
    """A note for the user, printed once per process (composition runs more than once in a study or a test)."""
    if message not in _said:
        _said.add(message)
        print(f"gpo: {message}", file=sys.stderr, flush=True)


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, ListConfig)):
        return [str(v) for v in value]
    return [str(value)]


def _group_file(group: str, name: str) -> Path:
    path = CONFIG_ROOT / group / f"{name}.yaml"
    if not path.is_file():
        raise UserError(
            f"unknown {group} `{name}`. Valid choices: {', '.join(choices(group)) or '(none)'}."
            + did_you_mean(name, choices(group))
        )
    return path


def _group_node(group: str, name: str) -> Any:
    if group in COMPONENT_GROUPS and not (CONFIG_ROOT / group / f"{name}.yaml").is_file():
        registry.get(group, name)  # a plug-in without YAML is fine; an unknown name raises with the choices
        return {"name": name}
    node = _load_yaml(_group_file(group, name))
    if group in COMPONENT_GROUPS:
        node.setdefault("name", name)
    return node


def _looks_like_model_path(value: str) -> bool:
    return "/" in value or value.endswith(".gguf") or Path(value).expanduser().exists()


def _user_file(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"--config file `{p}` does not exist.")
    return p


def _load_yaml(path: Path) -> DictConfig:
    try:
        node = OmegaConf.load(path)
    except Exception as exc:
        raise UserError(f"cannot read YAML `{path}`: {exc}") from exc
    if node is None:
        return OmegaConf.create({})
    if not isinstance(node, DictConfig):
        raise UserError(f"`{path}` must hold a mapping at the top level.")
    return node
