"""The MLflow tracker against a real `mlflow server` process: a child run of a study's parent run with params,
metrics and artifacts, then the server dies mid-run and the rest lands in the JSONL file (the in-process checks
of the tracker are in tests/unit/test_tracking.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from gpo.tracking import MlflowConfig, MlflowTracker
from kit import (  # noqa: F401  (mlflow_connections is a fixture)
    TRACKED_CONFIG_YAML,
    free_port,
    mlflow_connections,
    read_jsonl,
    until,
    warnings_from_tracker,
)

# --- a real mlflow server ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on a free local port with a SQLite backend; always terminated (its whole process group)."""
    root = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    # Job execution spawns several consumer processes that take seconds to start and are not needed here.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")]
    log_file = (root / "server.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)

    def answers() -> bool:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=5):
                return True
        except OSError:
            return False

    try:
        until(answers, "answer on /health", proc, log=root / "server.log")
        yield uri, stop
    finally:
        stop()
        log_file.close()


def test_real_server_child_run_then_server_dies(mlflow_server, tmp_path, caplog, mlflow_connections):  # noqa: F811
    from mlflow.tracking import MlflowClient

    uri, stop_server = mlflow_server
    client = MlflowClient(tracking_uri=uri)
    parent = client.create_run(client.create_experiment("study"), run_name="study-parent").info.run_id

    run_dir = tmp_path / "child"
    cfg = MlflowConfig(uri=uri, experiment="study", parent_run_id=parent, tags={"trial": "3"}, request_retries=0)
    t = MlflowTracker(cfg, run_dir=str(run_dir))
    t.start("trial-3", {"optim": {"lr": 2e-6}, "train": {"group_size": 8}}, TRACKED_CONFIG_YAML)
    t.log_metrics({"loss": 1.5}, step=0)
    t.log_metrics({"loss": 1.25}, step=1)
    artifact = tmp_path / "notes.txt"
    artifact.write_text("hello")
    t.log_artifact(str(artifact))

    run = client.get_run(t.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.tags["trial"] == "3"
    assert run.data.params == {"optim.lr": "2e-06", "train.group_size": "8"}
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "loss")] == [(0, 1.5), (1, 1.25)]
    assert sorted(a.path for a in client.list_artifacts(t.run_id)) == ["config.yaml", "notes.txt"]
    config_copy = client.download_artifacts(t.run_id, "config.yaml", str(tmp_path))
    assert Path(config_copy).read_text() == TRACKED_CONFIG_YAML
    assert f"{uri}/#/experiments/{run.info.experiment_id}/runs/{t.run_id}" in t.location()
    assert not warnings_from_tracker(caplog)

    # The server goes away mid-run: the run goes on, later steps land in the JSONL file, one warning.
    stop_server()
    mlflow_connections.clear()
    t.log_metrics({"loss": 1.0}, step=2)
    t.log_metrics({"loss": 0.75}, step=3)
    t.end()
    # request_retries=0: one refused connection, no retry (MLflow's default is minutes of them), nothing after it.
    assert mlflow_connections == [("127.0.0.1", int(uri.rsplit(":", 1)[1]))]
    assert len(warnings_from_tracker(caplog)) == 1
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert [(x["step"], x["loss"]) for x in lines[:2]] == [(2, 1.0), (3, 0.75)]
    assert lines[2]["status"] == "FINISHED"
