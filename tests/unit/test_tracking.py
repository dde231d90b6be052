"""Trackers: the null object does nothing; MLflow logs params, per-step metrics, the config and artifacts into
a local SQLite store, and it falls back to a JSONL file when the server is unreachable (a real `mlflow server`:
tests/integration/test_tracking_server.py)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from gpo import config
from gpo.errors import UserError
from gpo.tracking import (
    METRICS_PER_BATCH,
    PARAM_VALUE_MAX_CHARS,
    MlflowConfig,
    MlflowTracker,
    NullTracker,
    batches,
    flatten,
    param_value,
)
from kit import (  # noqa: F401  (mlflow_connections is a fixture)
    HANG_S,
    TRACKED_CONFIG_YAML,
    free_port,
    mlflow_connections,
    read_jsonl,
    warnings_from_tracker,
)


@pytest.fixture
def probes(monkeypatch) -> list[tuple[str, float]]:
    """(url, timeout) of every urllib request, which is how the tracker probes a server's /health."""
    seen: list[tuple[str, float]] = []
    plain = urllib.request.urlopen

    def counted(url, *args, timeout=None, **kwargs):
        seen.append((url, timeout))
        return plain(url, *args, timeout=timeout, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", counted)
    return seen


# --- pure helpers ------------------------------------------------------------------------------------------------


def test_flatten_gives_dotted_keys_and_keeps_lists_and_empty_sections_as_values():
    nested = {"optim": {"lr": 1e-5, "betas": [0.9, 0.99]}, "model": {"lora": {"rank": 8}}, "plugins": [], "x": {}}
    assert flatten(nested) == {
        "optim.lr": 1e-5,
        "optim.betas": [0.9, 0.99],
        "model.lora.rank": 8,
        "plugins": [],
        "x": {},
    }


def test_param_value_is_a_string_cut_to_mlflows_limit():
    assert param_value(1e-5) == "1e-05"
    assert param_value([0.9, 0.99]) == "[0.9, 0.99]"  # JSON, not Python repr, for lists
    assert param_value(None) == "None"
    long = param_value("a" * 600)
    # 500 characters in all: 497 kept + "..."
    assert len(long) == PARAM_VALUE_MAX_CHARS == 500
    assert long == "a" * 497 + "..."
    assert param_value("a" * 500) == "a" * 500  # exactly at the limit: unchanged


def test_batches_split_at_the_limit():
    # 250 items in batches of 100: 100 + 100 + 50
    assert [len(b) for b in batches(list(range(250)), 100)] == [100, 100, 50]
    assert list(batches([], 100)) == []


# --- the null tracker ---------------------------------------------------------------------------------------------


def test_null_tracker_does_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    artifact = tmp_path / "model.txt"
    artifact.write_text("weights")
    t = NullTracker()
    t.start("run", {"optim": {"lr": 1.0}}, TRACKED_CONFIG_YAML)
    t.log_metrics({"loss": 1.0}, step=0)
    t.log_artifact(str(artifact))
    t.log_summary({"accuracy": 0.5})
    t.end("FAILED")
    assert "off" in t.location()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.txt"]  # wrote nothing


# --- construction and config ---------------------------------------------------------------------------------------


def test_config_composes_and_builds_with_the_run_dir(tmp_path):
    cfg = config.compose(["tracker=mlflow", "tracker.tags.team=rl", "tracker.experiment=cppo"])
    tracker_cfg = cfg.tracker.config  # the composed run config holds the tracker's typed config
    assert tracker_cfg == MlflowConfig(experiment="cppo", tags={"team": "rl"})
    t = MlflowTracker(tracker_cfg, run_dir=str(tmp_path / "run"))
    assert t.uri == f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}"
    assert "run not started" in t.location()


def test_default_run_dir_is_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert MlflowTracker().run_dir == tmp_path / "runs"


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"uri": "some/dir"}, "not a tracking URI"),
        ({"parent_run_id": "abc"}, "needs tracker.uri"),
        ({"experiment": ""}, "tracker.experiment"),
        ({"request_retries": -1}, "request_retries"),
        ({"probe_timeout_s": 0}, "probe_timeout_s"),
    ],
)
def test_bad_config_is_a_user_error(settings, words, tmp_path):
    """Built as the composer builds `tracker=mlflow tracker.KEY=...`: ranges by the config's annotations, the
    rest by the tracker."""
    from gpo import registry

    with pytest.raises(UserError, match=words):
        registry.get("tracker", "mlflow").build(settings, run_dir=str(tmp_path))


def test_mlflow_is_imported_only_when_a_run_starts(tmp_path):
    code = (
        "import sys; from gpo.tracking import MlflowTracker; "
        f"t = MlflowTracker(run_dir={str(tmp_path)!r}); t.location(); "
        "assert 'mlflow' not in sys.modules, 'mlflow imported at construction'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=HANG_S)


# --- batching, against a recording client ---------------------------------------------------------------------------


class RecordingClient:
    def __init__(self):
        self.calls = []

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self.calls.append((len(metrics), len(params), len(tags)))


def started_with(client: RecordingClient, tmp_path: Path) -> MlflowTracker:
    t = MlflowTracker(run_dir=str(tmp_path))
    t._client, t.run_id, t.active = client, "run-1", True
    return t


def test_one_log_batch_per_step(tmp_path):
    client = RecordingClient()
    t = started_with(client, tmp_path)
    for step in range(3):
        t.log_metrics({"loss": 1.0, "reward/mean": 0.5, "kept_fraction": 0.25}, step)
    assert client.calls == [(3, 0, 0)] * 3


def test_log_batch_splits_at_mlflows_request_limits(tmp_path):
    client = RecordingClient()
    t = started_with(client, tmp_path)
    # 1500 metrics -> 1000 + 500; 120 params + 30 tags = 150 params-or-tags -> 100 + 50 (params come first)
    t._log_batch(
        metrics=[(f"m{i}", 0.0, 0, 0) for i in range(1500)],
        params=[(f"p{i}", "v") for i in range(120)],
        tags=[(f"t{i}", "v") for i in range(30)],
    )
    assert METRICS_PER_BATCH == 1000
    # first request: 1000 metrics, params 0..99; second: 500 metrics, params 100..119 and the 30 tags
    assert client.calls == [(1000, 100, 0), (500, 20, 30)]


# --- local SQLite store (the default) -------------------------------------------------------------------------------


def test_local_store_round_trip(tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    t = MlflowTracker(MlflowConfig(tags={"team": "rl"}), run_dir=str(run_dir))
    # 150 params: more than one log_batch may carry; one value longer than MLflow's 500-character limit
    params = {"optim": {"lr": 1e-5, "betas": [0.9, 0.99]}, "many": {f"k{i}": i for i in range(148)},
              "note": "x" * 700}
    t.start("grpo-test", params, TRACKED_CONFIG_YAML)
    t.log_metrics({"loss": 0.5, "reward/mean": 0.25}, step=0)
    t.log_metrics({"loss": 0.25, "reward/mean": 0.75}, step=1)
    artifact = tmp_path / "eval.json"
    artifact.write_text('{"accuracy": 0.5}')
    t.log_artifact(str(artifact))
    t.log_summary({"final_accuracy": 0.75, "final_model": "/runs/x/final"})
    t.end()

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "grpo-test"
    assert client.get_experiment(run.info.experiment_id).name == "gpo"
    p = run.data.params
    assert len(p) == 151  # optim.lr, optim.betas, note, 148 x many.k*
    assert p["optim.lr"] == "1e-05" and p["optim.betas"] == "[0.9, 0.99]" and p["many.k147"] == "147"
    assert p["note"] == "x" * 497 + "..."
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "loss")] == [(0, 0.5), (1, 0.25)]
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "reward/mean")] == [(0, 0.25), (1, 0.75)]
    # the summary's numbers are metrics at the last step logged (1); every summary entry is also a tag
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "final_accuracy")] == [(1, 0.75)]
    tags = run.data.tags
    assert tags["team"] == "rl" and tags["final_model"] == "/runs/x/final" and tags["final_accuracy"] == "0.75"
    # artifacts live beside the database, inside the run directory
    assert sorted(a.path for a in client.list_artifacts(t.run_id)) == ["config.yaml", "eval.json"]
    stored = next(run_dir.glob("mlartifacts/*/artifacts/config.yaml"))
    assert stored.read_text() == TRACKED_CONFIG_YAML
    assert f"mlflow ui --backend-store-uri sqlite:///{run_dir / 'mlflow.db'}" in t.location()
    assert t.run_id in t.location()
    assert not warnings_from_tracker(caplog)
    assert not (run_dir / "metrics.jsonl").exists()
    t.end()  # a second end() is a no-op


# --- unreachable server -----------------------------------------------------------------------------------------------


def test_unreachable_server_falls_back_to_jsonl_with_one_warning(tmp_path, caplog, probes, mlflow_connections):  # noqa: F811
    port = free_port()  # bound and released: nobody listens there
    run_dir = tmp_path / "run"
    t = MlflowTracker(MlflowConfig(uri=f"http://127.0.0.1:{port}"), run_dir=str(run_dir))
    t.start("r", {"optim": {"lr": 1e-5}}, TRACKED_CONFIG_YAML)
    for step in range(3):
        t.log_metrics({"loss": float(step)}, step)
    t.log_artifact(str(run_dir / "config.yaml"))
    t.log_summary({"final_model": "/m", "accuracy": 0.5})
    t.end("FAILED")
    # One bounded probe and not a single MLflow request (whose retries could stall the run for minutes).
    assert probes == [(f"http://127.0.0.1:{port}/health", t.cfg.probe_timeout_s)]
    assert mlflow_connections == []

    warned = warnings_from_tracker(caplog)
    assert len(warned) == 1
    assert "metrics.jsonl" in warned[0].getMessage() and str(port) in warned[0].getMessage()
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert [(x["step"], x["loss"]) for x in lines[:3]] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert lines[3]["summary"] == {"final_model": "/m", "accuracy": 0.5}
    assert lines[4]["status"] == "FAILED"
    assert (run_dir / "config.yaml").read_text() == TRACKED_CONFIG_YAML  # the config survives the dead server
    assert "metrics.jsonl" in t.location()
