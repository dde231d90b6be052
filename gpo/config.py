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
import importlib.util
import json
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from gpo import registry
from gpo.errors import UserError, did_you_mean
from gpo.run_config import (
    KINDS,
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
    cannot_run_ahead,
)
from gpo.schema import PRECISION_NAMES, RUN_CHECK, not_a_section, valid_keys_hint, validated

__all__ = ["CheckpointConfig", "EngineConfig", "EvalConfig", "ModelConfig", "OptimConfig", "RunConfig",
           "StudyConfig", "TrainConfig", "as_layer", "choices", "compose", "split_args", "to_yaml", "validate",
           "validated"]

CONFIG_ROOT = Path(str(files("gpo.configs")))
PLAIN_GROUPS = ("model", "engine")
GROUPS = KINDS + PLAIN_GROUPS + ("experiment",)
AUTO_BACKEND = "auto"  # not a component: compose() replaces it by gpo.backends.pick_auto's choice
STUDY_KEYS = ("grid", "baseline", "study")  # a study's own top-level keys; gpo.study takes them out before composing
TOP_LEVEL = tuple(f.name for f in dataclasses.fields(RunConfig)
                  if f.name not in SECTIONS and f.name not in KINDS)


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


def _override_layer(overrides: Sequence[str], holds_text: Callable[[str], bool] | None) -> DictConfig:
    """The dotted overrides as one layer, each value read as YAML (`train.steps=10` a number, `[a,b]` a list).

    A key whose field holds text (`holds_text(key)`) keeps the text as typed where YAML would read something else:
    `task.user_template={q}` is a mapping to YAML, `Q: {q}` one too, and `{q} and {r}` no YAML at all; a quoted
    value (`"{q}"`) and `null` stay as YAML reads them. With `holds_text` None (the components are not known yet)
    a value YAML cannot read is left out, for the final parse to report."""
    kept = []
    for arg in overrides:
        key, _, text = arg.partition("=")
        try:
            value = OmegaConf.select(OmegaConf.from_dotlist([arg]), key)
        except Exception as exc:
            if holds_text is not None and holds_text(key):
                kept.append(f"{key}={json.dumps(text, ensure_ascii=False)}")  # a JSON string is a quoted YAML one
            elif holds_text is not None:
                raise UserError(f"cannot parse overrides {arg}: {' '.join(str(exc).split())}. Values are read as "
                                    "YAML: quote one that YAML reads specially (`*`, `&`, `!`, `{`), e.g. "
                                    "key=['*'].") from None
            continue
        if value is not None and not isinstance(value, str) and holds_text is not None and holds_text(key):
            arg = f"{key}={json.dumps(text, ensure_ascii=False)}"
        kept.append(arg)
    return OmegaConf.from_dotlist(kept)


def _text_fields(merged: DictConfig) -> Callable[[str], bool]:
    """Whether a dotted key names a field whose type is text (`str` or `str | None`): a top-level field, a
    section's or the picked component's (the one `merged` names), through nested dataclasses."""

    def holds_text(key: str) -> bool:
        first, *rest = key.split(".")
        try:
            if first in KINDS:
                hint: Any = registry.get(first, str(OmegaConf.select(merged, f"{first}.name"))).config
            elif first in SECTIONS:
                hint = SECTIONS[first]
            elif first in TOP_LEVEL:
                hint, rest = RunConfig, [first, *rest]
            else:
                return False
            for part in rest:
                hint = typing.get_type_hints(hint).get(part) if dataclasses.is_dataclass(hint) else None
        except Exception:  # an unknown component or a plug-in's unreadable annotation: validation names it
            return False
        options = set(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else {hint}
        return str in options and options <= {str, type(None)}

    return holds_text


# --- composition ----------------------------------------------------------------------------------------------


def _completion_length(prelim: DictConfig) -> int:
    """train.max_completion_length as the layers set it (the default where none does), for backend=auto; a value
    that is not a positive integer counts as the default here and is refused by validation afterwards."""
    value = OmegaConf.select(prelim, "train.max_completion_length", default=None)
    default = TrainConfig.max_completion_length
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _model_dtype(prelim: DictConfig) -> str:
    """model.dtype as the layers set it (another name of a dtype as its own), for backend=auto's precision."""
    dtype = OmegaConf.select(prelim, "model.dtype", default="float32")
    return str(PRECISION_NAMES.canonical(dtype, ("float32", "bfloat16", "float16")))


def compose(args: Sequence[str] = (), config_files: Sequence[str | Path] = (),
            layers: Sequence[Mapping[str, Any]] = ()) -> RunConfig:
    """Build and validate the run config from command-line style arguments, files and in-memory layers."""
    plain, auto_note = _merged(args, config_files, layers)
    notes = [auto_note] if auto_note else []
    cfg = validate(plain, notes)
    for note in notes:  # only for a valid config: an error message stays the one line it is
        say_once(note)
    return cfg


def picked_components(args: Sequence[str] = (), layers: Sequence[Mapping[str, Any]] = ()) -> dict[str, str]:
    """The component of each kind that the arguments and layers pick, read before any setting is checked: a study
    asks this to learn which `kind.field` settings apply to a combination (the others are dropped from it)."""
    plain, _ = _merged(args, (), layers)
    return {kind: _component_entry(kind, plain.get(kind)).name for kind in KINDS}


def _merged(args: Sequence[str], config_files: Sequence[str | Path],
            layers: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """Every layer merged into one plain mapping, not yet validated, and backend=auto's note (None without it)."""
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

    # Plug-ins must be imported before group picks are resolved: they may bring components without YAML files.
    registry.load_builtins()
    readable = _override_layer(overrides, None)  # what YAML can read of them before the field types are known
    prelim = cast(DictConfig, OmegaConf.merge(base, *stack, readable))
    registry.load_plugins(_as_list(prelim.get("plugins")))
    auto_note = None
    if picked.get("backend") == AUTO_BACKEND:
        from gpo.backends import layered_precision, pick_auto

        precision = layered_precision(OmegaConf.select(prelim, "backend"), _model_dtype(prelim))
        picked["backend"], why = pick_auto(_completion_length(prelim), precision)
        auto_note = f"backend=auto picked `{picked['backend']}`: {why}."

    groups = OmegaConf.create({group: _group_node(group, name) for group, name in picked.items()})
    # The components are known now, so each override's field type is: a text field keeps the text as typed.
    picked_names = cast(DictConfig, OmegaConf.merge(base, groups, *stack, readable))
    merged = OmegaConf.merge(base, groups, *stack, _override_layer(overrides, _text_fields(picked_names)))
    try:
        plain = cast(dict[str, Any], OmegaConf.to_container(merged, resolve=True))
    except Exception as exc:  # an interpolation `${...}` that points nowhere
        raise UserError(f"cannot resolve the config: {exc}") from None
    return plain, auto_note


def validate(raw: Mapping[str, Any], notes: list[str] | None = None) -> RunConfig:
    """A plain mapping (every layer merged) as the typed run config, or a UserError naming the first problem.
    The built-in components and the mapping's `plugins` are imported first (a fresh process can validate a saved
    config). `auto` precisions come back resolved for this machine, with the reason added to `notes`."""
    raw = dict(_plain(raw))
    registry.load_builtins()
    registry.load_plugins(_as_list(raw.get("plugins")))
    top = set(TOP_LEVEL) | set(SECTIONS) | set(KINDS)
    for key in raw:
        if key in STUDY_KEYS:
            raise UserError(f"`{key}` is read by `gpo study` (a grid of runs), not by a single run: run this "
                            "experiment or file with `gpo study`.")
        if key not in top:
            raise UserError(f"unknown key `{key}`." + did_you_mean(str(key), top) + valid_keys_hint(top))
    values: dict[str, Any] = {}
    for kind in KINDS:
        values[kind] = _component(kind, raw.get(kind))
    for name, schema in SECTIONS.items():
        node = raw.get(name)
        if node is not None and not isinstance(node, Mapping):
            raise UserError(not_a_section(name, node, schema))
        values[name] = validated(node or {}, schema, name)
    cfg = validated({k: raw[k] for k in TOP_LEVEL if k in raw}, _TopLevel, "")
    cfg = RunConfig(**values, **{k: getattr(cfg, k) for k in TOP_LEVEL})
    cfg, note = _resolve_auto_precision(cfg)
    if note and notes is not None:
        notes.append(note)
    _check_together(cfg)
    for part in cfg.components().values():  # each component's own rules across sections (gpo.schema)
        check = getattr(part.config, RUN_CHECK, None)
        if callable(check):
            check(cfg)
    return cfg


def _resolve_auto_precision(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """engine.mixed_precision=auto and backend.precision=auto (the defaults) as this machine's fastest precision
    that trains as well as float32: bf16 rollouts and updates where bfloat16 runs natively, float32 elsewhere (the
    measurements are in docs/precision.md). Where the pick is float32, vLLM keeps its own `auto` (float32 on CPU,
    the policy's dtype on GPU)."""
    from gpo.backends import resolves_auto_precision, with_auto_precision

    mixed = cfg.engine.mixed_precision == "auto"
    if not (mixed or resolves_auto_precision(cfg.backend)):
        return cfg, None
    from gpo.hardware import auto_precision, mixed_precision

    pick, why = auto_precision(cfg.model.dtype)
    backend, rollout = with_auto_precision(cfg.backend, pick)
    if not (mixed or rollout):
        return cfg, None
    engine, chosen = cfg.engine, []
    if mixed:
        engine = dataclasses.replace(engine, mixed_precision=mixed_precision("auto", cfg.model.dtype))
        chosen.append(f"engine.mixed_precision={engine.mixed_precision}")
    if rollout:
        chosen.append(rollout)
    note = f"precision auto: {' '.join(chosen)} ({why})." if why else None  # a pin by the environment is not said
    return dataclasses.replace(cfg, engine=engine, backend=backend), note


def component(kind: str, name: str, **values: Any) -> Component:
    """One component as a run would get it from `kind=name`: its shipped YAML (if any) with `values` over it."""
    node = _plain(_group_node(kind, name))
    return _component(kind, {**node, **values})


def choices(group: str) -> list[str]:
    """Names a group pick may take: its YAML files, plus registered components that ship none (plug-ins)."""
    folder = CONFIG_ROOT / group
    found = {p.stem for p in folder.glob("*.yaml")} if folder.is_dir() else set()
    if group in KINDS:
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
    entry = _component_entry(kind, node)
    body = {k: v for k, v in node.items() if k != "name"}
    return Component(kind, entry.name, validated(body, entry.config, kind))


def _component_entry(kind: str, node: Any) -> Any:
    if node is not None and not isinstance(node, Mapping):
        raise UserError(f"`{kind}` must be a section with a `name`, got {node!r}; pick a component with "
                        f"`{kind}=NAME` (choices: {', '.join(choices(kind))}).")
    if node is None or "name" not in node:
        raise UserError(f"`{kind}` is missing: pick one with `{kind}=NAME` (choices: {', '.join(choices(kind))}).")
    return registry.get(kind, str(node["name"]))


def _check_together(cfg: RunConfig) -> None:
    """Rules that involve two fields of the plain sections, or the registry. A component's own rules across
    sections are its config's `check_run` (gpo.schema), called after these."""
    eval_cfg = cfg.eval
    too_big = [k for k in eval_cfg.pass_k if k > eval_cfg.samples]
    if too_big:
        raise UserError(f"eval.pass_k holds {too_big[0]}, more than eval.samples={eval_cfg.samples}: pass@k needs "
                        f"at least k samples per question (raise eval.samples or drop that k).")
    if cfg.engine.offload and cfg.engine.deepspeed_stage == 0:
        raise UserError("engine.offload needs DeepSpeed: set engine.deepspeed_stage=2 or 3 (engine=zero2 / zero3).")
    _check_precision(cfg)
    _check_async(cfg)
    for name in eval_cfg.tasks:  # scored at the end of the run: a typo must fail now, not after training
        registry.get("task", str(name))


def _check_async(cfg: RunConfig) -> None:
    """What a generator running ahead (train.max_staleness >= 1, gpo/generator.py) supports so far."""
    max_staleness = cfg.train.max_staleness
    if cfg.train.weight_updates == "inflight" and not max_staleness:
        raise UserError("train.weight_updates=inflight hands newer weights to a generator running ahead, and "
                        "train.max_staleness=0 runs none (every step already generates with the newest weights): "
                        "set train.max_staleness >= 1, or drop train.weight_updates.")
    if cfg.engine.generator == "ray" and not max_staleness:
        raise UserError("engine.generator=ray places a generator running ahead, and train.max_staleness=0 runs none: "
                        "set train.max_staleness >= 1, or drop engine.generator.")
    if not max_staleness:
        return
    why = None
    if cfg.engine.deepspeed_stage:
        why = "trains under plain DDP or on one process, not under DeepSpeed (engine.deepspeed_stage=0)"
    elif cfg.engine.generator == "ray" and importlib.util.find_spec("ray") is None:
        why = "on a Ray actor (engine.generator=ray) needs Ray: pip install 'gpo[ray]' (or pip install ray)"
    elif cfg.backend.name not in ("hf", "vllm"):
        why = f"generates with backend=hf or backend=vllm; backend={cfg.backend.name} is lockstep only"
    if why:  # what a backend's own settings allow is its config's check_run
        raise cannot_run_ahead(cfg, why)


def _check_precision(cfg: RunConfig) -> None:
    """Mixed precision keeps float32 master weights: they must be loaded in float32. Under DeepSpeed the module
    itself holds 16-bit copies, so its no-grad passes cannot run in another precision than training."""
    mixed, logprob = cfg.engine.mixed_precision, cfg.engine.logprob_precision
    if mixed != "no" and cfg.model.dtype != "float32":
        raise UserError(f"engine.mixed_precision={mixed} keeps float32 master weights, but model.dtype="
                        f"{cfg.model.dtype} loads them in 16 bits: set model.dtype=float32 (mixed precision) or "
                        f"engine.mixed_precision=no (training in {cfg.model.dtype} throughout).")
    if cfg.engine.deepspeed_stage and mixed != "no" and logprob not in ("train", mixed):
        raise UserError(f"engine.logprob_precision={logprob} with DeepSpeed and engine.mixed_precision={mixed}: "
                        f"DeepSpeed holds the policy's weights in {mixed}, so its log-prob passes run in {mixed}; "
                        f"use engine.logprob_precision=train.")


def _as_node(layer: Mapping[str, Any], what: str) -> DictConfig:
    node = OmegaConf.create(dict(layer))
    if not isinstance(node, DictConfig):
        raise UserError(f"{what} must be a mapping.")
    return node


# --- helpers ----------------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


_said: set[str] = set()


def say_once(message: str) -> None:
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
    if group in KINDS and not (CONFIG_ROOT / group / f"{name}.yaml").is_file():
        registry.get(group, name)  # a plug-in without YAML is fine; an unknown name raises with the choices
        return {"name": name}
    node = _load_yaml(_group_file(group, name))
    if group in KINDS:
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
