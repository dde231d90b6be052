"""Experiment trackers (`tracker=`): where a run's params, per-step metrics and artifacts go.

`none` does nothing (dry runs, tests). `mlflow` logs to MLflow: by default into a SQLite store inside the run
directory, so no server is needed; or to any tracking URI (`tracker.uri=http://127.0.0.1:5000`).
Why SQLite: MLflow 3.17's file store (`file://.../mlruns`) is in maintenance mode and raises unless
MLFLOW_ALLOW_FILE_STORE=true is exported; SQLite pays once per run directory to create its tables (seconds on a
small CPU, docs/benchmarks.md), then milliseconds per logged step.

Only rank 0 tracks: the engine builds the configured tracker on rank 0 and `none` on every other rank, so
nothing here knows about distributed training.

mlflow is imported inside the methods that need it (it takes seconds), so `gpo run --dry-run` never imports it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpo.errors import UserError
from gpo.registry import register
from gpo.schema import NonNegativeInt, Positive, TrackingUri

log = logging.getLogger(__name__)

# MLflow 3 accepts 6000-character param values, but older servers (and Databricks) reject more than 500; the
# full config is logged as the `config.yaml` artifact anyway, so a truncated param loses nothing.
PARAM_VALUE_MAX_CHARS = 500
PARAMS_AND_TAGS_PER_BATCH = 100  # MLflow's limit on params + tags in one log_batch request
METRICS_PER_BATCH = 1000  # MLflow's limit on metrics in one log_batch request
FALLBACK_FILE = "metrics.jsonl"
RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")


@dataclass(frozen=True)
class NullConfig:
    pass


@register("tracker", "none", config=NullConfig)
class NullTracker:
    """Log nothing (the null object for optional tracking)."""

    def __init__(self, cfg: NullConfig | None = None, **_: Any) -> None:
        self.cfg = cfg

    def start(self, run_name: str, params: dict[str, Any], config_yaml: str) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str) -> None:
        pass

    def log_summary(self, metrics: dict[str, Any]) -> None:
        pass

    def end(self, status: str = "FINISHED") -> None:
        pass

    def location(self) -> str:
        return "tracking is off (tracker=none)"


# --- params: nested config -> MLflow's flat string params -------------------------------------------------------


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings become dotted keys: {"optim": {"lr": 1e-5}} -> {"optim.lr": 1e-5}. Lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


def param_value(value: Any, max_chars: int = PARAM_VALUE_MAX_CHARS) -> str:
    """A param as MLflow stores it: a string, cut to `max_chars` with a trailing '...' when longer."""
    text = json.dumps(value) if isinstance(value, (list, tuple, Mapping)) else str(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# --- mlflow -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlflowConfig:
    # tracking URI; None = sqlite:///<run_dir>/mlflow.db, artifacts in <run_dir>/mlartifacts
    uri: TrackingUri | None = None
    experiment: str = "gpo"
    parent_run_id: str | None = None  # studies: log this run as a child of that run (needs `uri`: the same store)
    tags: dict[str, str] = field(default_factory=dict)  # a mapping: read only, never changed after composing
    probe_timeout_s: Positive = 2.0  # an http(s) server that does not answer /health within this is treated as down
    request_timeout_s: Positive = 10.0  # per MLflow HTTP request once the run is going
    request_retries: NonNegativeInt = 1  # MLflow's default (7, exponential backoff) can stall a step for minutes


@register("tracker", "mlflow", config=MlflowConfig)
class MlflowTracker:
    """Log params, per-step metrics and artifacts to MLflow; fall back to a local JSONL file if it is unreachable.

    Every failure to reach the store (at start or later) switches the tracker to the fallback for the rest of
    the run: the run goes on, metrics are appended to <run_dir>/metrics.jsonl, and one warning says so.
    """

    def __init__(self, cfg: MlflowConfig | None = None, run_dir: str | os.PathLike = "runs", **_: Any) -> None:
        self.cfg = cfg = cfg or MlflowConfig()
        if not cfg.experiment:
            raise UserError("tracker.experiment must name an MLflow experiment, got an empty string.")
        if cfg.uri is not None and "://" not in cfg.uri and not cfg.uri.startswith("databricks"):
            raise UserError(
                f"tracker.uri `{cfg.uri}` is not a tracking URI: use e.g. http://127.0.0.1:5000 or "
                "sqlite:////abs/path/mlflow.db (MLflow 3 no longer accepts plain directories by default)."
            )
        if cfg.parent_run_id and cfg.uri is None:
            raise UserError(
                "tracker.parent_run_id needs tracker.uri: the parent run must live in the same store as its "
                "children, and the default store is private to each run directory."
            )
        self.run_dir = Path(run_dir).resolve()
        self.local_store = cfg.uri is None
        self.uri: str = f"sqlite:///{self.run_dir / 'mlflow.db'}" if cfg.uri is None else cfg.uri
        self.fallback_path = self.run_dir / FALLBACK_FILE
        self.fallback_reason: str | None = None  # set once the store proved unreachable
        self.run_id: str | None = None
        self.active = False  # between a successful start() and end()
        self.experiment_id: str | None = None
        self._client: Any = None
        self._last_step = 0

    # --- the Tracker interface ---

    def start(self, run_name: str, params: dict[str, Any], config_yaml: str) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        unreachable = self._probe()
        if unreachable:
            self._fall_back(unreachable)
        else:
            self._try(lambda: self._create_run(run_name, config_yaml), "starting the run")
            if self.fallback_reason is None:
                self._log_batch(params=[(k, param_value(v)) for k, v in flatten(params).items()])
        if self.fallback_reason is not None and not (self.run_dir / "config.yaml").exists():
            (self.run_dir / "config.yaml").write_text(config_yaml)  # the config must survive a dead server

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        values = {name: float(value) for name, value in metrics.items()}
        self._last_step = step
        if self.fallback_reason is None:
            self._require_started()
            now = _millis()
            self._log_batch(metrics=[(name, value, now, step) for name, value in values.items()])
        if self.fallback_reason is not None:  # also true when the batch above just failed: no step is lost
            self._append({"step": step, "time": time.time(), **values})

    def log_artifact(self, path: str) -> None:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"tracker: artifact `{path}` does not exist")
        if self.fallback_reason is not None:
            return  # the file is already on local disk; nothing to copy it to
        self._require_started()
        if p.is_dir():
            self._try(lambda: self._client.log_artifacts(self.run_id, str(p), artifact_path=p.name), "an artifact")
        else:
            self._try(lambda: self._client.log_artifact(self.run_id, str(p)), "an artifact")

    def log_summary(self, metrics: dict[str, Any]) -> None:
        """Final results (accuracy, path of the final model...): numbers as metrics at the last step, all as tags."""
        numbers = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        if self.fallback_reason is None:
            self._require_started()
            now = _millis()
            self._log_batch(
                metrics=[(k, v, now, self._last_step) for k, v in numbers.items()],
                tags=[(k, param_value(v, max_chars=5000)) for k, v in metrics.items()],
            )
        if self.fallback_reason is not None:
            self._append({"summary": {k: v if _is_number(v) else str(v) for k, v in metrics.items()},
                          "time": time.time()})

    def end(self, status: str = "FINISHED") -> None:
        if status not in RUN_STATUSES:
            raise ValueError(f"tracker: run status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
        if self.fallback_reason is None and self.active:
            self._try(lambda: self._client.set_terminated(self.run_id, status), "ending the run")
        if self.fallback_reason is not None:
            self._append({"status": status, "time": time.time()})
        self.active = False  # a second end() is a no-op

    def location(self) -> str:
        """Where the run is and how to open it, for the engine to print."""
        if self.fallback_reason is not None:
            return f"metrics in {self.fallback_path} (MLflow was unreachable: {self.fallback_reason})"
        if self.run_id is None:
            return f"MLflow at {self.uri} (run not started)"
        run = f"MLflow run {self.run_id} (experiment `{self.cfg.experiment}`)"
        if self.uri.startswith(("http://", "https://")):
            return f"{run}: open {self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"{run} in {self.uri}; open it with: mlflow ui --backend-store-uri {self.uri}"

    # --- MLflow calls ---

    def _create_run(self, run_name: str, config_yaml: str) -> None:
        from mlflow.tracking import MlflowClient
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        with warnings.catch_warnings():
            # SQLAlchemy warns about a loader strategy inside MLflow's own store; nothing a user can act on.
            warnings.filterwarnings("ignore", message=".*noload.*")
            client = MlflowClient(tracking_uri=self.uri)
            self.experiment_id = self._experiment_id(client)
        tags = dict(self.cfg.tags)
        if self.cfg.parent_run_id:
            self._check_parent(client)
            tags[MLFLOW_PARENT_RUN_ID] = self.cfg.parent_run_id
        self._client = client
        self.run_id = client.create_run(self.experiment_id, run_name=run_name, tags=tags).info.run_id
        self.active = True
        client.log_text(self.run_id, config_yaml, "config.yaml")

    def _experiment_id(self, client: Any) -> str:
        from mlflow.exceptions import MlflowException

        found = client.get_experiment_by_name(self.cfg.experiment)
        if found is not None:
            return found.experiment_id
        # The local store keeps its artifacts beside the database, inside the run directory.
        artifacts = (self.run_dir / "mlartifacts").as_uri() if self.local_store else None
        try:
            return client.create_experiment(self.cfg.experiment, artifact_location=artifacts)
        except MlflowException:  # a sibling run of a study created it in the meantime
            found = client.get_experiment_by_name(self.cfg.experiment)
            if found is None:
                raise
            return found.experiment_id

    def _check_parent(self, client: Any) -> None:
        from mlflow.exceptions import MlflowException

        try:
            client.get_run(self.cfg.parent_run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise UserError(f"tracker.parent_run_id `{self.cfg.parent_run_id}`: no such run in {self.uri}.") from None

    def _log_batch(self, metrics: Sequence[tuple] = (), params: Sequence[tuple] = (),
                   tags: Sequence[tuple] = ()) -> None:
        """One log_batch request, or a few when MLflow's per-request limits force a split."""
        from mlflow.entities import Metric, Param, RunTag

        keyed = [Param(k, v) for k, v in params] + [RunTag(k, v) for k, v in tags]
        metric_chunks = list(batches([Metric(*m) for m in metrics], METRICS_PER_BATCH))
        keyed_chunks = list(batches(keyed, PARAMS_AND_TAGS_PER_BATCH))
        for i in range(max(len(metric_chunks), len(keyed_chunks))):
            chunk_m = metric_chunks[i] if i < len(metric_chunks) else []
            chunk_k = keyed_chunks[i] if i < len(keyed_chunks) else []
            ok = self._try(  # called at once; the defaults bind this iteration's chunks all the same
                lambda chunk_m=chunk_m, chunk_k=chunk_k: self._client.log_batch(
                    self.run_id,
                    metrics=chunk_m,
                    params=[e for e in chunk_k if isinstance(e, Param)],
                    tags=[e for e in chunk_k if isinstance(e, RunTag)],
                ),
                "a log_batch request",
            )
            if not ok:
                return

    def _try(self, call: Any, what: str) -> bool:
        """Run an MLflow call with bounded HTTP retries; on failure switch to the JSONL fallback."""
        try:
            with self._bounded_http():
                call()
            return True
        except UserError:
            raise
        except Exception as exc:  # any store failure must not end a training run
            self._fall_back(f"{what} failed: {type(exc).__name__}: {_first_line(exc)}")
            return False

    @contextmanager
    def _bounded_http(self) -> Iterator[None]:
        """MLflow reads its HTTP retry settings from the environment on every request; bound them while we call.

        Values the user exported themselves win.
        """
        wanted = {
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(self.cfg.request_retries),
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(math.ceil(self.cfg.request_timeout_s)),
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        }
        ours = [k for k in wanted if k not in os.environ]
        os.environ.update({k: wanted[k] for k in ours})
        try:
            yield
        finally:
            for k in ours:
                os.environ.pop(k, None)

    def _probe(self) -> str | None:
        """Why an http(s) tracking server is unreachable, or None. Local stores are not probed."""
        if not self.uri.startswith(("http://", "https://")):
            return None
        url = self.uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=self.cfg.probe_timeout_s):
                return None
        except urllib.error.HTTPError:
            return None  # it answered: a proxy without /health is still a server
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            return f"no answer from {url} within {self.cfg.probe_timeout_s:g} s ({reason})"

    # --- fallback ---

    def _fall_back(self, reason: str) -> None:
        if self.fallback_reason is None:
            self.fallback_reason = reason
            log.warning(
                "MLflow tracking at %s failed (%s); the run goes on and writes its metrics to %s from now on.",
                self.uri, reason, self.fallback_path,
            )

    def _append(self, record: dict[str, Any]) -> None:
        self.fallback_path.parent.mkdir(parents=True, exist_ok=True)
        with self.fallback_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _require_started(self) -> None:
        if not self.active:
            raise RuntimeError("MlflowTracker: call start() before logging (or after end())")


def _millis() -> int:
    return int(time.time() * 1000)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
