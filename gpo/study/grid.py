"""The grid of a study: which runs `gpo study ARGS` asks for, composed and validated before anything runs.

The grid is the cartesian product of every comma-separated value (commas inside [..], {..} or quotes belong to
the value). A component override that does not exist in a combination's picked component (`pruner.rate` under
`pruner=none`) is dropped from that combination, and combinations that then resolve to the same config run once.

Replicates: `seed` is the replicate axis. `seed=1,2,3` (or `study.seeds=3`: the configured seed and the next two)
runs every combination once per seed; runs that differ only in their seed form one group, the unit the tables
summarise with confidence intervals and pair with the baseline by seed. Runs go seed by seed (every combination
with the first seed, then every one with the next), so a drift in the machine's speed over a long study falls on
every combination alike, not on the ones planned last.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from gpo.errors import UserError, did_you_mean
from gpo.run_config import as_dict

# Sections a grid may not vary: the study sets them for every run (one directory, one MLflow store).
RESERVED = ("run_name", "output_dir", "resume", "tracker", "study")
SEED = "seed"


# --- the grid ---------------------------------------------------------------------------------------------------


@dataclass
class Spec:
    """What a study is asked for, before any config is composed."""

    fixed: list[str]  # key=value arguments shared by every run
    axes: list[tuple[str, list[str]]]  # grid keys in order, each with its values (the first key varies slowest)
    layers: list[dict]  # experiment and --config contents, in layering order, without `grid`, `baseline`, `study`
    baseline: dict[str, str] | None  # key -> value that picks the baseline run; None = the first run
    options: Any = None  # gpo.config.StudyConfig: the `study:` sections of the files, then `study.KEY=V` arguments


@dataclass
class PlannedRun:
    index: int  # 1-based
    combination: str  # the grid values this run takes, e.g. "algo=dapo pruner=topk pruner.rate=0.5 seed=2"
    group: str  # the same without the seed: the runs of one group are replicates of each other
    seed: int
    settings: dict[str, str]  # every key=value that made it (fixed and grid), for --baseline matching
    cfg: Any  # gpo.run_config.RunConfig: resolved and validated, before the study's own run_name/output_dir/tracker


@dataclass
class Plan:
    runs: list[PlannedRun]
    baseline: int  # index into runs; every run of its group is a baseline run (paired with others by seed)
    notes: list[str] = field(default_factory=list)  # dropped overrides and merged duplicates, said once each
    options: Any = None  # gpo.config.StudyConfig

    def baseline_runs(self) -> list[PlannedRun]:
        """The runs of the baseline's group: one per seed."""
        return [r for r in self.runs if r.group == self.runs[self.baseline].group]


def split_values(text: str) -> list[str]:
    """`0.5,0.75` -> ["0.5", "0.75"]; commas inside brackets, braces or quotes stay: `[a,b],[c]` -> two values."""
    values: list[str] = []
    current: list[str] = []
    depth, quote = 0, None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append("".join(current))
            current = []
            continue
        current.append(ch)
    values.append("".join(current))
    return values


def parse_spec(args: list[str], config_files: Sequence[str | Path] = (), baseline: str | None = None) -> Spec:
    """Separate grid axes from fixed arguments; read `grid:`/`baseline:` out of experiment and --config files."""
    from gpo.config import _group_file  # the composer's own lookup, with its message for unknown names

    layers: list[Path] = []
    file_axes: list[tuple[str, list[str]]] = []
    file_baseline = None
    rest = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if key == "experiment" and sep:
            if "," in value:
                raise UserError("experiment cannot be a grid axis: put a `grid:` mapping in the experiment instead.")
            layers.append(_group_file("experiment", value))
        else:
            rest.append(arg)
    layers += [Path(p).expanduser() for p in config_files]

    contents, option_layers = [], []
    for path in layers:
        node = _read_layer(path)
        if "study" in node:
            option_layers.append(node.pop("study"))
        grid = node.pop("grid", None)
        if grid is not None:
            file_axes = _merge_axes(file_axes, _grid_axes(grid, path))
        if "baseline" in node:
            file_baseline = _settings_of(node.pop("baseline"), f"`baseline` in {path}")
        contents.append(node)

    fixed, cli_axes, cli_keys, option_args = [], [], set(), []
    for arg in rest:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise UserError(f"cannot read `{arg}`: arguments are `group=name` picks or `key=value` overrides.")
        if key.split(".")[0] == "study":
            option_args.append(arg)
            continue
        values = split_values(value)
        if any(v == "" for v in values):
            raise UserError(f"`{arg}`: empty value in a comma-separated list.")
        if key in cli_keys:
            raise UserError(f"`{key}` is given twice: list its values once, comma-separated.")
        cli_keys.add(key)
        if len(values) > 1:
            cli_axes.append((key, values))
        else:
            fixed.append(arg)
    # The command line wins over the files (as in `gpo run`): its value or axis replaces a file's axis.
    axes = [(k, v) for k, v in file_axes if k not in cli_keys] + cli_axes
    for key, _ in axes:
        if key.split(".")[0] in RESERVED:
            raise UserError(f"`{key}` cannot be a grid axis: the study sets it for every run.")
    chosen = _settings_of(baseline, "--baseline") if baseline else file_baseline
    options = study_options(option_layers, option_args)
    if options.seeds > 1:
        if any(k == SEED for k, _ in axes):
            raise UserError("give the replicate seeds once: either `seed=1,2,3` or `study.seeds=3`, not both.")
        first = int(next((a.partition("=")[2] for a in reversed(fixed) if a.partition("=")[0] == SEED),
                         _configured_seed(contents)))
        fixed = [a for a in fixed if a.partition("=")[0] != SEED]
        axes.append((SEED, [str(first + i) for i in range(options.seeds)]))
    return Spec(fixed=fixed, axes=axes, layers=contents, baseline=chosen, options=options)


def study_options(layers: list[Any], args: list[str]) -> Any:
    """The study's own settings (gpo.config.StudyConfig), checked like any config section."""
    from gpo.config import StudyConfig, validated

    try:  # a file's section is the `study:` mapping itself; arguments are `study.KEY=VALUE`
        merged = cast(DictConfig, OmegaConf.merge(  # mappings merge into a mapping
            *[OmegaConf.create({"study": layer or {}}) for layer in layers], OmegaConf.from_dotlist(args)))
    except Exception as exc:
        raise UserError(f"cannot read the study settings {' '.join(args)}: {exc}") from exc
    node = merged.get("study", OmegaConf.create({}))
    if not isinstance(node, DictConfig):
        raise UserError(f"`study` must be a section of keys such as study.seeds, got {node!r}.")
    return validated(cast(dict[str, Any], OmegaConf.to_container(node, resolve=True)), StudyConfig, "study")


def _configured_seed(layers: list[dict]) -> int:
    from gpo.run_config import RunConfig

    seed: Any = next(f.default for f in dataclasses.fields(RunConfig) if f.name == SEED)
    for layer in layers:
        seed = layer.get(SEED, seed)
    return int(seed)


def plan(args: list[str], config_files: Sequence[str | Path] = (), baseline: str | None = None) -> Plan:
    """Compose and validate every run of the grid, dropping overrides that do not apply and merging duplicates."""
    spec = parse_spec(args, config_files, baseline)
    # The seed varies slowest, so replicates interleave; each combination still lists its keys in the axes' order.
    position = {key: i for i, (key, _) in enumerate(spec.axes)}
    seed_first = sorted(spec.axes, key=lambda axis: axis[0] != SEED)
    combos = [tuple(sorted(combo, key=lambda kv: position[kv[0]]))
              for combo in itertools.product(*[[(k, v) for v in values] for k, values in seed_first])]
    runs: list[PlannedRun] = []
    notes: list[str] = []
    inapplicable: list[dict[str, tuple[str, str]]] = []  # per combination: dropped key -> (kind, component)
    seen: dict[str, PlannedRun] = {}
    for combo in combos:
        args_here = spec.fixed + [f"{k}={v}" for k, v in combo]
        names = _picked_components(args_here, spec.layers)
        kept_args, dropped = _applicable_args(args_here, names)
        layers = []
        for layer in spec.layers:
            kept_layer, dropped_here = _applicable_layer(layer, names)
            layers.append(kept_layer)
            dropped |= dropped_here
        inapplicable.append(dropped)
        for key, (kind, name) in dropped.items():
            note = f"`{key}` does not apply to {kind} `{name}`: dropped from its runs."
            if note not in notes:
                notes.append(note)
        cfg = _compose(kept_args, layers)
        label = " ".join(f"{k}={v}" for k, v in combo if k not in dropped) or "(defaults)"
        fingerprint = json.dumps(as_dict(cfg), sort_keys=True, default=str)
        if fingerprint in seen:
            original = " ".join(f"{k}={v}" for k, v in combo)
            notes.append(f"`{original}` resolves to the same config as `{seen[fingerprint].combination}`: "
                         "it runs once.")
            continue
        settings = {k: v for k, _, v in (a.partition("=") for a in kept_args)}
        group = " ".join(f"{k}={v}" for k, v in combo if k not in dropped and k != SEED) or "(defaults)"
        seen[fingerprint] = PlannedRun(index=len(runs) + 1, combination=label, group=group, seed=int(cfg.seed),
                                       settings=settings, cfg=cfg)
        runs.append(seen[fingerprint])
    _no_key_dropped_everywhere(inapplicable)
    return Plan(runs=runs, baseline=_baseline_index(runs, spec.baseline), notes=notes, options=spec.options)


def _no_key_dropped_everywhere(inapplicable: list[dict[str, tuple[str, str]]]) -> None:
    """A component key that applies to no run of the grid is a mistake (a typo), not a combination to skip."""
    everywhere = set.intersection(*[set(d) for d in inapplicable]) if inapplicable else set()
    for key in sorted(everywhere):
        kind = key.split(".")[0]
        components = sorted({d[key][1] for d in inapplicable})
        valid = sorted({f"{kind}.{f}" for name in components for f in _fields(kind, name)})
        raise UserError(f"`{key}` is not a field of {kind} {' or '.join(f'`{c}`' for c in components)}."
                        + did_you_mean(".".join(key.split(".")[:2]), valid) + f" Valid keys: {', '.join(valid)}.")


def _grid_axes(grid: Any, where: Path) -> list[tuple[str, list[str]]]:
    """A file's `grid:`: a mapping of dotted key (or nested mapping) -> non-empty list of values."""
    if not isinstance(grid, dict):
        raise UserError(f"`grid` in {where} must be a mapping of key -> list of values, got {grid!r}.")
    axes = []
    for key, values in grid.items():
        if isinstance(values, dict):  # nested keys: {pruner: {rate: [...]}} is pruner.rate
            axes += [(f"{key}.{k}", v) for k, v in _grid_axes(values, where)]
            continue
        if not isinstance(values, list) or not values:
            raise UserError(f"`grid.{key}` in {where} must be a non-empty list of values, got {values!r}.")
        if key in _group_names() and not all(isinstance(v, str) for v in values):
            raise UserError(f"`grid.{key}` in {where} picks components: its values must be names, got {values!r}.")
        axes.append((str(key), [_as_override_value(v) for v in values]))
    return axes


def _merge_axes(old: list[tuple[str, list[str]]], new: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    keys = {k for k, _ in new}
    return [(k, v) for k, v in old if k not in keys] + new


def _as_override_value(value: Any) -> str:
    """A YAML value as the text of a `key=value` override (JSON is valid YAML for anything not a plain word)."""
    if isinstance(value, str) and re.fullmatch(r"[\w./:+-]+", value):
        return value
    return json.dumps(value)


def _settings_of(value: Any, where: str) -> dict[str, str]:
    """A baseline given as "algo=grpo pruner=none" or as a mapping {algo: grpo, pruner: none}."""
    if isinstance(value, dict) and value:
        return {str(k): _as_override_value(v) for k, v in value.items()}
    if isinstance(value, str) and value.strip():
        pairs = [p.partition("=") for p in value.split()]
        if all(sep and k for k, sep, _ in pairs):
            return {k: v for k, _, v in pairs}
    raise UserError(f"{where} must name the baseline run by its settings, e.g. `algo=grpo pruner=none`, got {value!r}.")


def _baseline_index(runs: list[PlannedRun], wanted: dict[str, str] | None) -> int:
    if not wanted:
        return 0
    for i, run in enumerate(runs):
        if all(_same_value(run.settings.get(k), v) for k, v in wanted.items()):
            return i
    listed = "; ".join(r.combination for r in runs)
    shown = " ".join(f"{k}={v}" for k, v in wanted.items())
    raise UserError(f"baseline `{shown}` matches no run of the grid (runs: {listed}).")


def _same_value(a: str | None, b: str) -> bool:
    if a is None:
        return False
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def _group_names() -> tuple[str, ...]:
    from gpo.config import GROUPS

    return GROUPS


def _fields(kind: str, name: str) -> list[str]:
    from gpo import registry

    return ["name"] + [f.name for f in dataclasses.fields(registry.get(kind, name).config)]


def _picked_components(args: list[str], layers: list[dict]) -> dict[str, str]:
    from gpo.config import picked_components

    return picked_components(args, layers)


def _applicable_args(args: list[str], names: dict[str, str]) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """Drop `kind.field=...` where the picked component of that kind has no such field; keep everything else."""
    kept, dropped = [], {}
    for arg in args:
        key = arg.partition("=")[0]
        kind, _, rest = key.partition(".")
        if kind not in names or not rest or rest.split(".")[0] in _fields(kind, names[kind]):
            kept.append(arg)
        else:
            dropped[key] = (kind, names[kind])
    return kept, dropped


def _applicable_layer(layer: dict, names: dict[str, str]) -> tuple[dict, dict[str, tuple[str, str]]]:
    out = dict(layer)
    dropped: dict[str, tuple[str, str]] = {}
    for kind, name in names.items():
        section = layer.get(kind)
        if isinstance(section, dict):
            fields = _fields(kind, name)
            out[kind] = {k: v for k, v in section.items() if k in fields}
            dropped |= {f"{kind}.{k}": (kind, name) for k in section if k not in fields}
    return out, dropped


def _compose(args: list[str], layers: list[dict]) -> Any:
    from gpo.config import compose

    return compose(args, layers=layers)


def _read_layer(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"--config file `{path}` does not exist.")
    try:
        node = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as exc:
        raise UserError(f"cannot read YAML `{path}`: {exc}") from exc
    if node is None:
        return {}
    if not isinstance(node, dict):
        raise UserError(f"`{path}` must hold a mapping at the top level.")
    return node
