"""Running a study: every planned run in its own process, one after another or `study.parallel` at a time, on this
machine or as Ray tasks (`study.launcher=ray`), each recorded as a child of the study's MLflow parent run.

Each run is a separate process (`python -m gpo.study --child SPEC`):
- peak memory: `ru_maxrss` is a per-process high-water mark, so only a fresh process per run measures each run's
  own peak (in one process every later run would report the largest peak so far);
- isolation: a run that crashes, is killed for memory, or leaves global state behind (seeds, a torch.distributed
  group, CUDA caches, plug-in registrations) cannot disturb the runs after it;
- a run with engine.num_processes > 1 goes through `gpo run --config` under `accelerate launch` like any
  multi-process run (its peak memory is then the largest rank's).
With `study.parallel=N` up to N runs execute at once; on a machine with GPUs each takes its own
engine.num_processes devices (CUDA_VISIBLE_DEVICES), and waits while too few are free.

`study.resume=DIR` continues the study in DIR with the arguments it was started with (saved in
DIR/study-args.json): finished runs are kept, failed, killed and never-started ones run again (a re-run's old
directory is kept beside it as NAME.attempt-K). A finished run's training checkpoints are deleted once it is
recorded (`study.keep_checkpoints=true` keeps them): 1.6 GB per run of the 135M default, and 13 runs of a study
filled a disk with them.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from gpo import tracking_store as store
from gpo.config import component
from gpo.errors import UserError
from gpo.run_config import Component, RunConfig, as_dict
from gpo.study.child import Outcome, run_child
from gpo.study.grid import Plan, PlannedRun, plan
from gpo.study.report import write_outputs
from gpo.tracking_store import TAG_BASELINE, TAG_COMBINATION, TAG_GROUP, TAG_INDEX, TAG_PARENT, TAG_ROLE

ARGS_FILE = "study-args.json"


def study_from_args(args: list[str], config_files: Sequence[str] = (), baseline: str | None = None) -> int:
    """`gpo study ...`: plan the grid, run it, write the tables and plots. Exit code 0 even if some runs failed."""
    args, config_files, baseline, study_dir = _resumed(list(args), list(config_files), baseline)
    the_plan = plan(args, config_files, baseline)
    options = the_plan.options
    if options.launcher == "ray":
        from gpo.study.ray_launcher import require

        require()
    resuming = study_dir is not None
    if options.resume and not resuming:
        raise UserError("study.resume names the study to continue: give it on the command line "
                        "(`gpo study study.resume=DIR`), not in a file.")
    first = the_plan.runs[0].cfg
    if not resuming:
        study_dir = _new_dir(Path(first.output_dir), "study-" + time.strftime("%Y%m%d-%H%M%S"))
        saved = {"args": [a for a in args if not a.startswith("study.resume=")], "config_files":
                 [str(Path(f).resolve()) for f in config_files], "baseline": baseline}
        (study_dir / ARGS_FILE).write_text(json.dumps(saved, indent=2) + "\n")
    tracker = first.tracker
    if tracker.name != "mlflow":
        _say(f"a study tracks every run in one MLflow store: tracker `{tracker.name}` is replaced by mlflow.")
        tracker = component("tracker", "mlflow")
    uri = tracker.config.uri or f"sqlite:///{(study_dir / 'mlflow.db').resolve()}"
    experiment = tracker.config.experiment or "gpo"
    _say(f"study of {len(the_plan.runs)} runs in {study_dir}")
    for note in the_plan.notes:
        _say(note)
    base_group = the_plan.runs[the_plan.baseline].group
    for run in the_plan.runs:
        _say(f"  {run.index:>2}. {run.combination}{'  (baseline)' if run.group == base_group else ''}")

    client, experiment_id = store.open_store(uri, experiment, study_dir)
    parent, finished = _parent_run(client, experiment_id, study_dir, args, resuming)
    todo = [r for r in the_plan.runs if r.index not in finished]
    if finished:
        _say(f"resuming: {len(finished)} finished runs kept, {len(todo)} to run")
    run_ids: dict[int, str] = dict(finished)
    status, stop = "FAILED", None
    try:
        configs = {r.index: _study_config(r, the_plan, study_dir, uri, experiment, parent, tracker) for r in todo}
        for r in todo:
            _set_aside(client, experiment_id, parent, r, study_dir / configs[r.index].run_name)
        for run, outcome, log in _execute(todo, configs, options, study_dir):
            run_ids[run.index] = _record(client, experiment_id, parent, run, configs[run.index], outcome)
            if outcome.status == "FINISHED" and not options.keep_checkpoints:
                shutil.rmtree(study_dir / configs[run.index].run_name / "checkpoints", ignore_errors=True)
            detail = f": {outcome.error}" if outcome.error else ""
            _say(f"run {run.index}/{len(the_plan.runs)} `{run.combination}` {outcome.status}{detail} (log: {log})")
            if outcome.status != "FINISHED" and _says_disk_full(outcome.error):
                raise OSError(errno.ENOSPC, outcome.error)  # every later run would fail the same way
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except Exception as exc:
        if not _disk_full(exc):
            raise
        stop = UserError(_disk_full_message(study_dir, len(run_ids), len(the_plan.runs)))
    finally:  # the runs done so far are reported even when the study stops early
        outputs = _report(client, parent, status, [store.read_run(client, run_ids[i]) for i in sorted(run_ids)],
                          study_dir, uri, the_plan.notes)
    if outputs is None:  # the tables could not be written, even where every run was recorded
        raise stop or UserError(_disk_full_message(study_dir, len(run_ids), len(the_plan.runs)))
    if stop is not None:
        raise stop
    print((study_dir / "study.md").read_text(), flush=True)
    _say(f"tables and plots in {study_dir} ({', '.join(p.name for p in outputs)})")
    _say(f"MLflow: parent run {parent}; open with: mlflow ui --backend-store-uri {uri}")
    return 0


def _report(client: Any, parent: str, status: str, records: list, study_dir: Path, uri: str,
            notes: list[str]) -> list[Path] | None:
    """Write the study's tables and plots and attach them to the parent run; None when the disk is full (said
    here, and not raised: an error that stopped the study first is the one to show, and the recorded runs stay in
    the store for resume)."""
    try:
        outputs = write_outputs(records, study_dir, title=f"gpo study {study_dir.name}",
                                notes=[f"Parent run `{parent}` in `{uri}`.", *notes])
        for path in outputs:
            client.log_artifact(parent, str(path))
        client.set_terminated(parent, status)
        return outputs
    except Exception as exc:
        if not _disk_full(exc):
            raise
        _say("the study's tables were not written: the disk is full.")
        return None


def _says_disk_full(text: str) -> bool:
    return "No space left on device" in text or "disk is full" in text


def _disk_full(exc: BaseException) -> bool:
    """A full disk however it surfaced: OSError ENOSPC, or SQLite's "database or disk is full" that SQLAlchemy
    and MLflow wrap in exceptions of their own."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC or _says_disk_full(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _disk_full_message(study_dir: Path, kept: int, total: int) -> str:
    free = shutil.disk_usage(study_dir).free / 2**30 if study_dir.exists() else float("nan")
    return (f"the disk is full ({free:.1f} GiB free on the drive holding {study_dir}): the study stopped with "
            f"{kept} of {total} runs recorded; the finished ones are kept. Free space (each run's folder is in "
            f"{study_dir}; study.keep_checkpoints=true keeps 1.6 GB of checkpoints per run of the default model), "
            f"then continue the study with `gpo study study.resume={study_dir}`.")


def _resumed(args: list[str], config_files: list[str], baseline: str | None):
    """With study.resume=DIR: the arguments DIR was started with (plus any other study.* settings given now)."""
    given = [a for a in args if a.startswith("study.resume=")]
    if not given:
        return args, config_files, baseline, None
    study_dir = Path(given[-1].partition("=")[2]).expanduser()
    saved_file = study_dir / ARGS_FILE
    if not saved_file.is_file():
        raise UserError(f"study.resume={study_dir}: not a study directory (no {ARGS_FILE} there).")
    other = [a for a in args if not a.startswith("study.")]
    if other or config_files or baseline:
        raise UserError("study.resume continues a study with the arguments it was started with: give only "
                        f"study.* settings beside it, not {' '.join(other + list(config_files)) or '--baseline'}.")
    saved = json.loads(saved_file.read_text())
    options = [a for a in args if a.startswith("study.") and not a.startswith("study.resume=")]
    keys = {a.partition("=")[0] for a in options}
    kept = [a for a in saved["args"] if a.partition("=")[0] not in keys]
    return kept + options, saved["config_files"], saved["baseline"], study_dir


def _parent_run(client: Any, experiment_id: str, study_dir: Path, args: list[str],
                resuming: bool) -> tuple[str, dict[int, str]]:
    """The study's parent run (the existing one when resuming) and its finished children by grid index."""
    found = client.search_runs([experiment_id], filter_string=f"tags.{TAG_ROLE} = 'parent' and "
                               f"attributes.run_name = '{study_dir.name}'") if resuming else []
    if not found:
        parent = client.create_run(experiment_id, run_name=study_dir.name, tags={TAG_ROLE: "parent"}).info.run_id
        client.log_param(parent, "grid", " ".join(args)[:6000])
        return parent, {}
    parent = found[0].info.run_id
    client.update_run(parent, "RUNNING")
    done = client.search_runs([experiment_id], filter_string=f"tags.{TAG_PARENT} = '{parent}' and "
                              "attributes.status = 'FINISHED'")
    return parent, {int(r.data.tags[TAG_INDEX]): r.info.run_id for r in done if TAG_INDEX in r.data.tags}


def _set_aside(client: Any, experiment_id: str, parent: str, run: PlannedRun, run_dir: Path) -> None:
    """Before a run (re-)runs: an earlier attempt's MLflow run is deleted and its directory kept aside."""
    for old in client.search_runs([experiment_id], filter_string=f"tags.{TAG_PARENT} = '{parent}' and "
                                  f"tags.{TAG_INDEX} = '{run.index}'"):
        client.delete_run(old.info.run_id)
    if run_dir.exists():
        for k in range(1, 10_000):
            aside = run_dir.with_name(f"{run_dir.name}.attempt-{k}")
            if not aside.exists():
                shutil.move(str(run_dir), aside)
                break


def _study_config(run: PlannedRun, the_plan: Plan, study_dir: Path, uri: str, experiment: str, parent: str,
                  tracker: Component) -> RunConfig:
    """The run's config with the study's run name, directory and shared MLflow store."""
    from gpo.config import validate

    slug = re.sub(r"[^\w.=-]+", "_", run.combination)[:80]
    tags = {**dict(tracker.config.tags or {}),
            TAG_PARENT: parent, TAG_INDEX: str(run.index), TAG_COMBINATION: run.combination, TAG_GROUP: run.group}
    if run.group == the_plan.runs[the_plan.baseline].group:
        tags[TAG_BASELINE] = "true"
    kept = {k: v for k, v in as_dict(tracker).items() if k not in ("uri", "parent_run_id", "tags")}
    return validate({**as_dict(run.cfg), "run_name": f"{run.index:02d}-{slug}", "output_dir": str(study_dir),
                     "tracker": {**kept, "name": "mlflow", "uri": uri, "experiment": experiment,
                                 "parent_run_id": parent, "tags": tags}})


# --- executing runs -----------------------------------------------------------------------------------------------


def _run_dir(study_dir: Path, cfg: RunConfig) -> Path:
    """A run's folder in the study: the study names every run it plans (`_child_config`)."""
    assert cfg.run_name is not None
    return study_dir / cfg.run_name


def _execute(runs: list[PlannedRun], configs: dict[int, RunConfig], options: Any, study_dir: Path):
    """Yield (run, outcome, log path) as runs finish: in order when parallel=1, else as they complete."""
    if options.launcher == "ray":
        from gpo.study.ray_launcher import run_all

        yield from run_all(runs, configs, options)
        return
    devices = DevicePool(_cuda_devices())
    need = {r.index: _devices_needed(configs[r.index]) for r in runs}
    devices.check(max(need.values(), default=0))
    if options.parallel == 1:
        for run in runs:
            with devices.take(need[run.index]) as visible:
                outcome, log = run_child(configs[run.index], _run_dir(study_dir, configs[run.index]), visible)
            yield run, outcome, log
        return

    def one(run: PlannedRun) -> tuple[PlannedRun, Outcome, Path]:
        with devices.take(need[run.index]) as visible:
            return (run, *run_child(configs[run.index], _run_dir(study_dir, configs[run.index]), visible))

    with ThreadPoolExecutor(max_workers=options.parallel) as pool:  # threads only wait on the run processes
        pending: set[Future] = {pool.submit(one, run) for run in runs}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                yield future.result()


def _devices_needed(cfg: RunConfig) -> int:
    return int(cfg.engine.num_processes)


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class DevicePool:
    """`count` GPUs handed out to runs, a run waiting while too few are free; without GPUs (0) nobody waits."""

    def __init__(self, count: int) -> None:
        self.free = list(range(count))
        self.total = count
        self.changed = threading.Condition()

    def check(self, most: int) -> None:
        if self.total and most > self.total:
            raise UserError(f"a run needs {most} GPUs (engine.num_processes) but this machine shows {self.total}.")

    def take(self, n: int) -> Any:
        pool = self

        class Lease:
            def __enter__(self) -> list[int] | None:
                if not pool.total:
                    return None
                with pool.changed:
                    pool.changed.wait_for(lambda: len(pool.free) >= n)
                    self.ids, pool.free = pool.free[:n], pool.free[n:]
                return self.ids

            def __exit__(self, *exc: Any) -> None:
                if pool.total:
                    with pool.changed:
                        pool.free = sorted(pool.free + self.ids)
                        pool.changed.notify_all()

        return Lease()


def _record(client: Any, experiment_id: str, parent: str, run: PlannedRun, cfg: RunConfig, outcome: Outcome) -> str:
    """The run's MLflow id, with peak memory and any error attached. A run that failed before it reached
    MLflow gets a FAILED run of its own, so every row of the grid lives in the store."""
    from mlflow.entities import Param
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    from gpo.tracking import flatten, param_value

    found = client.search_runs([experiment_id], filter_string=f"tags.{TAG_PARENT} = '{parent}' and "
                               f"tags.{TAG_INDEX} = '{run.index}'")
    if found:
        run_id = found[0].info.run_id
        if outcome.status != "FINISHED" and found[0].info.status == "RUNNING":  # the process died mid-run
            client.set_terminated(run_id, outcome.status)
    else:
        tags = {**dict(cfg.tracker.config.tags or {}), MLFLOW_PARENT_RUN_ID: parent}
        run_id = client.create_run(experiment_id, run_name=cfg.run_name, tags=tags).info.run_id
        params = sorted(flatten(as_dict(cfg)).items())
        for lo in range(0, len(params), 100):
            client.log_batch(run_id, params=[Param(k, param_value(v)) for k, v in params[lo:lo + 100]])
        client.set_terminated(run_id, outcome.status)
    if outcome.error:
        client.set_tag(run_id, store.TAG_ERROR, outcome.error[:5000])
    for key, value in ((store.PEAK_RSS, outcome.peak_rss_mb), (store.PEAK_GPU, outcome.peak_gpu_mb)):
        if value is not None:
            client.log_metric(run_id, key, value)
    return run_id


def _new_dir(root: Path, name: str) -> Path:
    for n in range(1, 10_000):
        path = root / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise UserError(f"cannot create a fresh study directory under `{root}`.")


def _say(message: str) -> None:
    print(f"gpo: {message}", flush=True)
