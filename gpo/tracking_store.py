"""Reading runs back from MLflow, beside gpo.tracking which writes them: the tags that tie a study's runs together
and each run as a `RunRecord` (params, step metrics, summary), for `gpo study` and `gpo report`.

Every table and plot is built from what MLflow holds (never from the study's memory), so `gpo report` on the same
runs reproduces a study's outputs exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpo.errors import UserError

# Tags that tie the runs of a study together in MLflow (underscores: OmegaConf would read dots as nesting).
TAG_ROLE = "gpo_study_role"  # "parent" on the study's own run
TAG_PARENT = "gpo_study_parent"
TAG_INDEX = "gpo_study_index"  # 1-based position in the grid
TAG_COMBINATION = "gpo_study_combination"
TAG_GROUP = "gpo_study_group"  # the combination without its seed: runs of one group are replicates
TAG_BASELINE = "gpo_study_baseline"  # "true" on the runs speed-ups are measured against (one per seed)
TAG_ERROR = "gpo_study_error"
PEAK_RSS = "study/peak_rss_mb"
PEAK_GPU = "study/peak_gpu_mb"

STEP_METRICS = ("reward/mean", "reward/task_mean", "reward/success_rate", "time/step", "tokens/generated",
                "tokens/trained", "prune/kept_frac",
                "select/considered", "select/skipped", "select/screened_out", "select/completions",
                "select/completions_baseline", "select/useful_rows")  # what a selector saved (gpo/rollout_phases.py)
# Logged config values the tables read (the whole config is logged as params by the engine).
PARAMS = ("seed", "pruner.name", "pruner.rate", "pruner.keep", "train.group_size", "eval.split", "task.name")


@dataclass
class RunRecord:
    """One run as MLflow holds it: what the tables and plots are made of."""

    run_id: str
    name: str
    combination: str
    group: str  # runs sharing it are replicates (seeds) of one combination
    status: str
    error: str
    baseline: bool
    metrics: dict[str, float]  # latest value of each metric
    history: dict[str, list[tuple[int, float]]]  # (step, value) sorted by step, for STEP_METRICS
    params: dict[str, str]  # the PARAMS this run logged

    @property
    def seed(self) -> str | None:
        return self.params.get("seed")


def read_run(client: Any, run_id: str) -> RunRecord:
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        raise UserError(f"no MLflow run `{run_id}` in {client.tracking_uri}: {first_line(exc)}") from None
    history = {}
    for key in STEP_METRICS:
        by_step = {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}
        history[key] = sorted(by_step.items())  # a resumed run logs a step again: its last value counts
    tags = run.data.tags
    combination = tags.get(TAG_COMBINATION, "")
    return RunRecord(
        run_id=run_id, name=run.info.run_name or run_id, combination=combination,
        group=tags.get(TAG_GROUP) or combination or run.info.run_name or run_id,
        status=run.info.status, error=tags.get(TAG_ERROR, ""), baseline=tags.get(TAG_BASELINE) == "true",
        metrics=dict(run.data.metrics), history=history,
        params={k: v for k, v in run.data.params.items() if k in PARAMS},
    )


def client_for(uri: str) -> Any:
    import warnings

    from mlflow.tracking import MlflowClient

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*noload.*")  # SQLAlchemy, inside MLflow's own store
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # opens the store now, inside the filter
    return client


def open_store(uri: str, experiment: str, study_dir: Path) -> tuple[Any, str]:
    """The study's MLflow client and experiment; a new experiment keeps its artifacts inside the study directory."""
    client = client_for(uri)
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return client, found.experiment_id
    artifacts = (study_dir / "mlartifacts").resolve().as_uri()
    return client, client.create_experiment(experiment, artifact_location=artifacts)


def children(client: Any, run_id: str) -> list[str]:
    """The runs of a study, in grid order, when `run_id` is a study's parent run; else []."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        raise UserError(f"no MLflow run `{run_id}` in {client.tracking_uri}: {first_line(exc)}") from None
    if run.data.tags.get(TAG_ROLE) != "parent":
        return []
    found = client.search_runs([run.info.experiment_id], filter_string=f"tags.{TAG_PARENT} = '{run_id}'")
    return [r.info.run_id for r in sorted(found, key=lambda r: int(r.data.tags.get(TAG_INDEX, 0)))]


def tracking_uri(given: str | None) -> str:
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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
