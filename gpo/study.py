"""`gpo study` runs a grid of combinations and compares them; `gpo report` rebuilds that comparison from MLflow.

    gpo study algo=grpo,dapo pruner=none,topk pruner.rate=0.5,0.75,0.875 task=arith train.steps=30
    gpo study experiment=NAME            # the experiment YAML carries `grid:` (and optionally `baseline:`)
    gpo report RUN_ID... --tracking-uri sqlite:///runs/study-.../mlflow.db

The grid is the cartesian product of every comma-separated value (commas inside [..], {..} or quotes belong to
the value). A component override that does not exist in a combination's picked component (`pruner.rate` under
`pruner=none`) is dropped from that combination, and combinations that then resolve to the same config run once.

Each run is a separate process (`python -m gpo.study --child SPEC`), one after another:
- peak memory: `ru_maxrss` is a per-process high-water mark, so only a fresh process per run measures each run's
  own peak (in one process every later run would report the largest peak so far);
- isolation: a run that crashes, is killed for memory, or leaves global state behind (seeds, a torch.distributed
  group, CUDA caches, plug-in registrations) cannot disturb the runs after it.
A run costs one extra interpreter start (seconds), small against any real training run.

Everything lives in one study directory, `<output_dir>/study-<timestamp>/`: one SQLite MLflow store
(`mlflow.db`, artifacts in `mlartifacts/`) with a parent run and one child run per combination, each run's own
directory and log, and the outputs `study.csv`, `study.md`, `reward_vs_time.png`, `accuracy_vs_speedup.png`
(also artifacts of the parent run). The table is always built from what MLflow holds, so `gpo report` on the same
runs reproduces it exactly.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from gpo.errors import UserError, did_you_mean

# Tags that tie the runs of a study together in MLflow (underscores: OmegaConf would read dots as nesting).
TAG_ROLE = "gpo_study_role"  # "parent" on the study's own run
TAG_PARENT = "gpo_study_parent"
TAG_INDEX = "gpo_study_index"  # 1-based position in the grid
TAG_COMBINATION = "gpo_study_combination"
TAG_BASELINE = "gpo_study_baseline"  # "true" on the run speed-ups are measured against
TAG_ERROR = "gpo_study_error"
PEAK_RSS = "study/peak_rss_mb"
PEAK_GPU = "study/peak_gpu_mb"

COLUMNS = ["run", "combination", "status", "error", "acc_before", "acc_after", "final_reward", "train_s",
           "speedup", "kept_frac", "tokens_generated", "tokens_trained", "peak_rss_mb", "peak_gpu_mb", "wall_s",
           "run_id"]
PLOTS = ("reward_vs_time.png", "accuracy_vs_speedup.png")
# Sections a grid may not vary: the study sets them for every run (one directory, one MLflow store).
RESERVED = ("run_name", "output_dir", "resume", "tracker")


# --- the grid ---------------------------------------------------------------------------------------------------


@dataclass
class Spec:
    """What a study is asked for, before any config is composed."""

    fixed: list[str]  # key=value arguments shared by every run
    axes: list[tuple[str, list[str]]]  # grid keys in order, each with its values (the first key varies slowest)
    layers: list[dict]  # experiment and --config contents, in layering order, without `grid` and `baseline`
    baseline: dict[str, str] | None  # key -> value that picks the baseline run; None = the first run


@dataclass
class PlannedRun:
    index: int  # 1-based
    combination: str  # the grid values this run takes, e.g. "algo=dapo pruner=topk pruner.rate=0.5"
    settings: dict[str, str]  # every key=value that made it (fixed and grid), for --baseline matching
    cfg: DictConfig  # resolved and validated, before the study's own run_name/output_dir/tracker


@dataclass
class Plan:
    runs: list[PlannedRun]
    baseline: int  # index into runs
    notes: list[str] = field(default_factory=list)  # dropped overrides and merged duplicates, said once each


def split_values(text: str) -> list[str]:
    """`0.5,0.75` -> ["0.5", "0.75"]; commas inside brackets, braces or quotes stay: `[a,b],[c]` -> two values."""
    values, current, depth, quote = [], [], 0, None
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


def parse_spec(args: list[str], config_files: list[str | Path] = (), baseline: str | None = None) -> Spec:
    """Separate grid axes from fixed arguments; read `grid:`/`baseline:` out of experiment and --config files."""
    from gpo.config import _group_file  # the composer's own lookup, with its message for unknown names

    layers, file_axes, file_baseline = [], [], None
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

    contents = []
    for path in layers:
        node = _read_layer(path)
        grid = node.pop("grid", None)
        if grid is not None:
            file_axes = _merge_axes(file_axes, _grid_axes(grid, path))
        if "baseline" in node:
            file_baseline = _settings_of(node.pop("baseline"), f"`baseline` in {path}")
        contents.append(node)

    fixed, cli_axes, cli_keys = [], [], set()
    for arg in rest:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise UserError(f"cannot read `{arg}`: arguments are `group=name` picks or `key=value` overrides.")
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
    return Spec(fixed=fixed, axes=axes, layers=contents, baseline=chosen)


def plan(args: list[str], config_files: list[str | Path] = (), baseline: str | None = None) -> Plan:
    """Compose and validate every run of the grid, dropping overrides that do not apply and merging duplicates."""
    spec = parse_spec(args, config_files, baseline)
    combos = list(itertools.product(*[[(k, v) for v in values] for k, values in spec.axes]))
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
        fingerprint = json.dumps(OmegaConf.to_container(cfg, resolve=True), sort_keys=True, default=str)
        if fingerprint in seen:
            original = " ".join(f"{k}={v}" for k, v in combo)
            notes.append(f"`{original}` resolves to the same config as `{seen[fingerprint].combination}`: "
                         "it runs once.")
            continue
        settings = {k: v for k, _, v in (a.partition("=") for a in kept_args)}
        seen[fingerprint] = PlannedRun(index=len(runs) + 1, combination=label, settings=settings, cfg=cfg)
        runs.append(seen[fingerprint])
    _no_key_dropped_everywhere(inapplicable)
    return Plan(runs=runs, baseline=_baseline_index(runs, spec.baseline), notes=notes)


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


def _merge_axes(old: list[tuple[str, list[str]]], new: list[tuple[str, list[str]]]) -> list:
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
    import dataclasses

    from gpo import registry

    return ["name"] + [f.name for f in dataclasses.fields(registry.get(kind, name).config)]


def _picked_components(args: list[str], layers: list[dict]) -> dict[str, str]:
    """Which component each group resolves to, composed without any component settings (they cannot change it)."""
    from gpo.config import COMPONENT_GROUPS, split_args

    picks, overrides = split_args(args)
    plain = [o for o in overrides if o.partition("=")[0].split(".")[0] not in COMPONENT_GROUPS]
    bare = [{k: v for k, v in layer.items() if k not in COMPONENT_GROUPS} for layer in layers]
    cfg = _compose([f"{k}={v}" for k, v in picks.items()] + plain, bare)
    return {kind: str(cfg[kind].name) for kind in COMPONENT_GROUPS}


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
    out, dropped = dict(layer), {}
    for kind, name in names.items():
        section = layer.get(kind)
        if isinstance(section, dict):
            fields = _fields(kind, name)
            out[kind] = {k: v for k, v in section.items() if k in fields}
            dropped |= {f"{kind}.{k}": (kind, name) for k in section if k not in fields}
    return out, dropped


def _compose(args: list[str], layers: list[dict]) -> DictConfig:
    from gpo.config import compose

    with tempfile.TemporaryDirectory(prefix="gpo-study-") as tmp:
        files = []
        for i, layer in enumerate(layers):
            files.append(Path(tmp) / f"layer{i}.yaml")
            OmegaConf.save(OmegaConf.create(layer), files[-1])
        return compose(args, files)


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


# --- running ------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    status: str  # FINISHED | FAILED | KILLED
    error: str  # first line of the failure, "" when it finished
    peak_rss_mb: float | None
    peak_gpu_mb: float | None


def study_from_args(args: list[str], config_files: list[str] = (), baseline: str | None = None) -> int:
    """`gpo study ...`: plan the grid, run it, write the table and plots. Exit code 0 even if some runs failed."""
    the_plan = plan(list(args), list(config_files), baseline)
    first = the_plan.runs[0].cfg
    study_dir = _new_dir(Path(first.output_dir), "study-" + time.strftime("%Y%m%d-%H%M%S"))
    tracker = first.tracker
    if tracker.name != "mlflow":
        _say(f"a study tracks every run in one MLflow store: tracker `{tracker.name}` is replaced by mlflow.")
        tracker = OmegaConf.create({"name": "mlflow"})
    uri = tracker.get("uri") or f"sqlite:///{(study_dir / 'mlflow.db').resolve()}"
    experiment = tracker.get("experiment") or "gpo"
    _say(f"study of {len(the_plan.runs)} runs in {study_dir}")
    for note in the_plan.notes:
        _say(note)
    for run in the_plan.runs:
        mark = "  (baseline)" if run.index - 1 == the_plan.baseline else ""
        _say(f"  {run.index:>2}. {run.combination}{mark}")

    client, experiment_id = _store(uri, experiment, study_dir)
    parent = client.create_run(experiment_id, run_name=study_dir.name, tags={TAG_ROLE: "parent"}).info.run_id
    client.log_param(parent, "grid", " ".join(args))
    run_ids: list[str] = []
    status = "FAILED"
    try:
        for run in the_plan.runs:
            cfg = _study_config(run, the_plan, study_dir, uri, experiment, parent, tracker)
            outcome, log = _run_child(cfg, study_dir / cfg.run_name)
            run_ids.append(_record(client, experiment_id, parent, run, cfg, outcome))
            detail = f": {outcome.error}" if outcome.error else ""
            _say(f"run {run.index}/{len(the_plan.runs)} `{run.combination}` {outcome.status}{detail} (log: {log})")
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:  # the runs done so far are reported even when the study stops early
        records = [_read_run(client, rid) for rid in run_ids]
        outputs = write_outputs(records, study_dir, title=f"gpo study {study_dir.name}",
                                notes=[f"Parent run `{parent}` in `{uri}`.", *the_plan.notes])
        for path in outputs:
            client.log_artifact(parent, str(path))
        client.set_terminated(parent, status)
    print(_markdown(table(records)), flush=True)
    _say(f"table and plots in {study_dir} (study.md, study.csv, {', '.join(PLOTS)})")
    _say(f"MLflow: parent run {parent}; open with: mlflow ui --backend-store-uri {uri}")
    return 0


def _study_config(run: PlannedRun, the_plan: Plan, study_dir: Path, uri: str, experiment: str, parent: str,
                  tracker: DictConfig) -> DictConfig:
    """The run's config with the study's run name, directory and shared MLflow store."""
    from gpo.config import validate

    cfg = run.cfg.copy()
    slug = re.sub(r"[^\w.=-]+", "_", run.combination)[:80]
    cfg.run_name = f"{run.index:02d}-{slug}"
    cfg.output_dir = str(study_dir)
    tags = {**(OmegaConf.to_container(tracker.tags) if tracker.get("tags") else {}),
            TAG_PARENT: parent, TAG_INDEX: str(run.index), TAG_COMBINATION: run.combination}
    if run.index - 1 == the_plan.baseline:
        tags[TAG_BASELINE] = "true"
    kept = {k: v for k, v in OmegaConf.to_container(tracker).items() if k not in ("uri", "parent_run_id", "tags")}
    cfg.tracker = {**kept, "name": "mlflow", "uri": uri, "experiment": experiment, "parent_run_id": parent,
                   "tags": tags}
    return validate(cfg)


def _run_child(cfg: DictConfig, run_dir: Path) -> tuple[Outcome, Path]:
    """Train one run in a fresh interpreter; its stdout and stderr go to `<run_dir>/study.log`."""
    from gpo.config import to_yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    log_path, spec_path, result_path = run_dir / "study.log", run_dir / "study-spec.json", run_dir / "study-result.json"
    spec = {"config": to_yaml(cfg), "result": str(result_path), "sys_path": [p for p in sys.path if p]}
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpo.study", "--child", str(spec_path)], stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C reached the child too: let it save its checkpoint and end its run
            proc.wait()
            raise
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        outcome = Outcome(result["status"], result["error"], result["peak_rss_mb"], result["peak_gpu_mb"])
        return outcome, log_path
    last = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
    why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    error = f"the run's process ended without a result ({why}){': ' + last[0] if last else ''}"
    return Outcome("FAILED", error, None, None), log_path


def _child(spec_path: str) -> int:
    """Inside the run's own process: train, then report status and this process's peak memory."""
    spec = json.loads(Path(spec_path).read_text())
    # Plug-ins the study could import (e.g. added to sys.path by the caller) must import here too. Appended, never
    # prepended: the caller's path may end in folders such as setuptools/_vendor (added by importing setuptools),
    # whose old vendored copies would otherwise shadow the real packages in site-packages.
    sys.path.extend(p for p in spec["sys_path"] if p not in sys.path)
    status, error = "FAILED", ""
    try:
        from gpo import registry
        from gpo.config import validate
        from gpo.engine import train

        cfg = OmegaConf.create(spec["config"])
        registry.load_builtins()
        registry.load_plugins([str(m) for m in cfg.get("plugins") or []])
        train(validate(cfg))
        status = "FINISHED"
    except KeyboardInterrupt:
        status, error = "KILLED", "interrupted"
    except BaseException as exc:  # reported in the table; the traceback goes to the run's log
        import traceback

        traceback.print_exc()
        text = str(exc).strip()
        error = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
    Path(spec["result"]).write_text(json.dumps(
        {"status": status, "error": error, "peak_rss_mb": _peak_rss_mb(), "peak_gpu_mb": _peak_gpu_mb()}))
    return 0 if status == "FINISHED" else 1


def _peak_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def _peak_gpu_mb() -> float | None:
    torch = sys.modules.get("torch")  # never import torch just to ask
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def _record(client: Any, experiment_id: str, parent: str, run: PlannedRun, cfg: DictConfig, outcome: Outcome) -> str:
    """The run's MLflow id, with peak memory and any error attached. A run that failed before it reached
    MLflow gets a FAILED run of its own, so every row of the grid lives in the store."""
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    from gpo.tracking import flatten, param_value

    found = client.search_runs([experiment_id], filter_string=f"tags.{TAG_PARENT} = '{parent}' and "
                               f"tags.{TAG_INDEX} = '{run.index}'")
    if found:
        run_id = found[0].info.run_id
    else:
        tags = {**OmegaConf.to_container(cfg.tracker.tags), MLFLOW_PARENT_RUN_ID: parent}
        run_id = client.create_run(experiment_id, run_name=cfg.run_name, tags=tags).info.run_id
        params = flatten(OmegaConf.to_container(cfg, resolve=True))
        for chunk in _chunks(sorted(params.items()), 100):
            from mlflow.entities import Param

            client.log_batch(run_id, params=[Param(k, param_value(v)) for k, v in chunk])
        client.set_terminated(run_id, outcome.status)
    if outcome.error:
        client.set_tag(run_id, TAG_ERROR, outcome.error[:5000])
    for key, value in ((PEAK_RSS, outcome.peak_rss_mb), (PEAK_GPU, outcome.peak_gpu_mb)):
        if value is not None:
            client.log_metric(run_id, key, value)
    return run_id


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _store(uri: str, experiment: str, study_dir: Path) -> tuple[Any, str]:
    """The study's MLflow client and experiment; a new experiment keeps its artifacts inside the study directory."""
    client = _client(uri)
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return client, found.experiment_id
    artifacts = (study_dir / "mlartifacts").resolve().as_uri()
    return client, client.create_experiment(experiment, artifact_location=artifacts)


def _client(uri: str) -> Any:
    import warnings

    from mlflow.tracking import MlflowClient

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*noload.*")  # SQLAlchemy, inside MLflow's own store
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # opens the store now, inside the filter
    return client


def _new_dir(root: Path, name: str) -> Path:
    for n in itertools.count(1):
        path = root / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


# --- reading runs back -------------------------------------------------------------------------------------------


@dataclass
class RunRecord:
    """One run as MLflow holds it: what the table and plots are made of."""

    run_id: str
    name: str
    combination: str
    status: str
    error: str
    baseline: bool
    metrics: dict[str, float]  # latest value of each metric
    history: dict[str, list[tuple[int, float]]]  # (step, value) sorted by step, for the per-step metrics below


STEP_METRICS = ("reward/mean", "time/step", "tokens/generated", "tokens/trained", "prune/kept_frac")


def _read_run(client: Any, run_id: str) -> RunRecord:
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        raise UserError(f"no MLflow run `{run_id}` in {client.tracking_uri}: {_first_line(exc)}") from None
    history = {}
    for key in STEP_METRICS:
        by_step = {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}
        history[key] = sorted(by_step.items())  # a resumed run logs a step again: its last value counts
    tags = run.data.tags
    return RunRecord(
        run_id=run_id, name=run.info.run_name or run_id, combination=tags.get(TAG_COMBINATION, ""),
        status=run.info.status, error=tags.get(TAG_ERROR, ""), baseline=tags.get(TAG_BASELINE) == "true",
        metrics=dict(run.data.metrics), history=history,
    )


def table(records: list[RunRecord]) -> list[dict[str, Any]]:
    """One row per run, in the order given; speed-ups against the baseline run (tagged, else the first)."""
    rows = []
    for i, r in enumerate(records, start=1):
        times = [v for _, v in r.history["time/step"]]
        kept = [v for _, v in r.history["prune/kept_frac"]]
        rewards = r.history["reward/mean"]
        rows.append({
            "run": i,
            "combination": r.combination or r.name,
            "status": r.status,
            "error": r.error,
            "acc_before": r.metrics.get("eval/before/accuracy"),
            "acc_after": r.metrics.get("eval/after/accuracy"),
            "final_reward": r.metrics.get("final/reward_mean", rewards[-1][1] if rewards else None),
            "train_s": sum(times) if times else None,  # training steps only: evaluation and saving excluded
            "speedup": None,
            "kept_frac": sum(kept) / len(kept) if kept else None,
            "tokens_generated": sum(v for _, v in r.history["tokens/generated"]) if times else None,
            "tokens_trained": sum(v for _, v in r.history["tokens/trained"]) if times else None,
            "peak_rss_mb": r.metrics.get(PEAK_RSS),
            "peak_gpu_mb": r.metrics.get(PEAK_GPU),
            "wall_s": r.metrics.get("train/seconds"),  # the whole run: evaluation before and after, saving
            "run_id": r.run_id,
        })
    base = rows[_baseline_of(records)] if rows else None
    if base is not None and base["status"] == "FINISHED" and base["train_s"]:
        for row in rows:
            if row["status"] == "FINISHED" and row["train_s"]:
                row["speedup"] = base["train_s"] / row["train_s"]
    return rows


def _baseline_of(records: list[RunRecord]) -> int:
    """The run speed-ups are measured against: the one a study tagged, else the first."""
    return next((i for i, r in enumerate(records) if r.baseline), 0)


def write_outputs(records: list[RunRecord], out_dir: Path, title: str, notes: list[str] = ()) -> list[Path]:
    """study.csv, study.md and the two plots in `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = table(records)
    csv_path = out_dir / "study.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows([{k: "" if v is None else v for k, v in row.items()} for row in rows])
    base = rows[_baseline_of(records)]["combination"] if rows else ""
    plots = [_plot_reward_vs_time(records, out_dir / PLOTS[0]), _plot_accuracy_vs_speedup(rows, out_dir / PLOTS[1])]
    lines = [f"# {title}", "", *[f"- {n}" for n in notes], f"- Baseline for speed-ups: `{base}`. train_s sums the "
             "per-step times (evaluation and saving excluded); wall_s is the whole run.", "", _markdown(rows), ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    md_path = out_dir / "study.md"
    md_path.write_text("\n".join(lines) + "\n")
    return [csv_path, md_path, *plots]


def _markdown(rows: list[dict[str, Any]]) -> str:
    shown = [c for c in COLUMNS if c != "run_id"]
    formats = {"acc_before": "{:.3f}", "acc_after": "{:.3f}", "final_reward": "{:.3f}", "train_s": "{:.1f}",
               "speedup": "{:.2f}x", "kept_frac": "{:.3f}", "tokens_generated": "{:.0f}", "tokens_trained": "{:.0f}",
               "peak_rss_mb": "{:.0f}", "peak_gpu_mb": "{:.0f}", "wall_s": "{:.1f}"}

    def cell(col: str, value: Any) -> str:
        if value is None or value == "":
            return ""
        text = formats[col].format(value) if col in formats else str(value)
        return text.replace("|", "\\|")

    out = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    out += ["| " + " | ".join(cell(c, row[c]) for c in shown) + " |" for row in rows]
    return "\n".join(out)


def _figure() -> Any:
    # A bare Figure draws with the Agg canvas when saved: no pyplot, no global backend, no display needed.
    from matplotlib.figure import Figure

    return Figure(figsize=(7, 4.5), dpi=100, layout="constrained")


def _plot_reward_vs_time(records: list[RunRecord], path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    for i, r in enumerate(records, start=1):
        times = dict(r.history["time/step"])
        points = [(s, v) for s, v in r.history["reward/mean"] if s in times]
        if not points:
            continue
        elapsed = list(itertools.accumulate(times[s] for s, _ in points))  # wall-clock seconds at each step's end
        ax.plot(elapsed, [v for _, v in points], marker="o", markersize=3, label=f"{i}. {r.combination or r.name}")
    ax.set_xlabel("training time (s, sum of step times)")
    ax.set_ylabel("reward/mean")
    ax.set_title("Reward vs wall-clock time")
    if ax.has_data():
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no step metrics logged", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path)
    return path


def _plot_accuracy_vs_speedup(rows: list[dict[str, Any]], path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    points = [r for r in rows if r["speedup"] is not None and r["acc_after"] is not None]
    for r in points:
        ax.scatter(r["speedup"], r["acc_after"])
        ax.annotate(f"{r['run']}. {r['combination']}", (r["speedup"], r["acc_after"]), fontsize="small",
                    textcoords="offset points", xytext=(4, 4))
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)  # the baseline
    ax.set_ylim(-0.05, 1.05)
    ax.margins(x=0.25)  # room for the labels of the outermost points
    ax.set_xlabel("speed-up vs baseline (x)")
    ax.set_ylabel("eval/after/accuracy")
    ax.set_title("Accuracy vs speed-up")
    if not points:
        ax.text(0.5, 0.5, "no finished run with an accuracy after training", ha="center", va="center",
                transform=ax.transAxes)
    fig.savefig(path)
    return path


# --- gpo report -------------------------------------------------------------------------------------------------


def report(run_ids: list[str], tracking_uri: str | None = None, out_dir: str | Path = "report") -> list[Path]:
    """`gpo report RUN_ID...`: the study table and plots from existing runs. A study's parent run id stands for
    all its runs; the baseline is the run a study tagged, else the first one given."""
    uri = _tracking_uri(tracking_uri)
    client = _client(uri)
    ids: list[str] = []
    for run_id in run_ids:
        ids += _children(client, run_id) or [run_id]
    records = [_read_run(client, rid) for rid in ids]
    out = Path(out_dir)
    outputs = write_outputs(records, out, title=f"gpo report of {len(records)} runs", notes=[f"Runs in `{uri}`."])
    print(_markdown(table(records)), flush=True)
    _say(f"table and plots in {out} (study.md, study.csv, {', '.join(PLOTS)})")
    return outputs


def _children(client: Any, run_id: str) -> list[str]:
    """The runs of a study, in grid order, when `run_id` is a study's parent run; else []."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        raise UserError(f"no MLflow run `{run_id}` in {client.tracking_uri}: {_first_line(exc)}") from None
    if run.data.tags.get(TAG_ROLE) != "parent":
        return []
    found = client.search_runs([run.info.experiment_id], filter_string=f"tags.{TAG_PARENT} = '{run_id}'")
    return [r.info.run_id for r in sorted(found, key=lambda r: int(r.data.tags.get(TAG_INDEX, 0)))]


def _tracking_uri(given: str | None) -> str:
    """A tracking URI, or a study directory / .db file given as a path."""
    value = given or os.environ.get("MLFLOW_TRACKING_URI")
    if not value:
        raise UserError("gpo report needs --tracking-uri: a study's store, e.g. "
                        "sqlite:///runs/study-YYYYmmdd-HHMMSS/mlflow.db, or the study directory itself.")
    if "://" in value or value.startswith("databricks"):
        return value
    path = Path(value).expanduser()
    db = path / "mlflow.db" if path.is_dir() else path
    if not db.is_file():
        raise UserError(f"--tracking-uri `{value}`: no MLflow store there (expected a URI, a .db file, or a "
                        "directory holding mlflow.db).")
    return f"sqlite:///{db.resolve()}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _say(message: str) -> None:
    print(f"gpo: {message}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        raise SystemExit(_child(sys.argv[2]))
    raise SystemExit("usage: python -m gpo.study --child SPEC.json (internal: one run of `gpo study`)")
