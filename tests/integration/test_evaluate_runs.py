"""`gpo eval` as a real process and evaluation inside training runs, on the tiny model: reports written, MLflow
fed, sampled validation and further tasks scored. The evaluation logic on scripted completions is in
tests/unit/test_evaluate.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run_gpo_eval(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpo", "eval", *args, f"output_dir={tmp_path / 'runs'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_gpo_eval_end_to_end(tmp_path: Path, tiny_model_path: str, shared_data: Path) -> None:
    done = run_gpo_eval(tmp_path, f"model={tiny_model_path}", "task=gsm8k", "split=test", "limit=5", "tracker=none",
                        f"task.data_dir={shared_data}", "train.max_completion_length=8")
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs").glob("eval-gsm8k-test-*")
    rows = [json.loads(line) for line in (run_dir / "examples.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    assert set(rows[0]) >= {"prompt", "completion", "extracted", "gold", "correct"}
    assert rows[0]["gold"] == "18"  # Janet's ducks, the first GSM8K test question
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["n"] == 5 and summary["split"] == "test" and 0.0 <= summary["accuracy"] <= 1.0
    assert '"accuracy"' in done.stdout  # the summary is printed


def test_gpo_eval_logs_to_mlflow(tmp_path: Path, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpo.evaluate import evaluate_from_args

    monkeypatch.chdir(tmp_path)
    assert evaluate_from_args([f"model={tiny_model_path}", "task=arith", "limit=3", "tracker=mlflow",
                               "train.max_completion_length=4", f"output_dir={tmp_path / 'runs'}"], []) == 0
    (run_dir,) = (tmp_path / "runs").glob("eval-arith-test-*")

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.metrics["n"] == 3
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"examples.jsonl", "summary.json"}


def test_a_run_scores_sampled_validation_and_further_tasks_at_the_end(tmp_path, tiny_model_path, shared_data,
                                                                       monkeypatch):
    from gpo.config import compose
    from gpo.engine import train

    monkeypatch.setenv("GPO_DATA_DIR", str(shared_data))  # amc23's Hub source is read from the local copy
    cfg = compose([f"model={tiny_model_path}", "tracker=none", "algo=grpo", "pruner=none", "allocator=static",
                   f"output_dir={tmp_path}", "train.steps=1", "train.questions_per_step=1", "train.group_size=2",
                   "train.max_completion_length=4", "eval.limit=2", "eval.batch_size=4", "eval.samples=2",
                   "eval.tasks=[arith,amc23]", "checkpoint.save_final_model=false"])
    summary = train(cfg)
    for prefix in ("eval/before/", "eval/after/", "eval/after/arith/", "eval/after/amc23/"):
        assert summary[prefix + "n"] == 2, prefix  # eval.limit applies to each
        assert 0.0 <= summary[prefix + "maj_at_2"] <= summary[prefix + "pass_at_2"] <= 1.0
        assert summary[prefix + "pass_at_1"] == pytest.approx(summary[prefix + "accuracy"])  # avg@2 = pass@1


def test_validation_during_training_is_sampled_too(tmp_path, tiny_model_path):
    from mlflow.tracking import MlflowClient

    from gpo.config import compose
    from gpo.engine import train

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train(compose([f"model={tiny_model_path}", "tracker=mlflow", f"tracker.uri={uri}", "task=arith", "algo=grpo",
                   "pruner=none", "allocator=static", f"output_dir={tmp_path}", "run_name=r", "train.steps=2",
                   "train.questions_per_step=1", "train.group_size=2", "train.max_completion_length=4",
                   "eval.every=1", "eval.before_and_after=false", "eval.limit=2", "eval.samples=4",
                   "eval.pass_k=[1,3]", "checkpoint.save_final_model=false"]))
    client = MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"eval/validation/{k}")]
               for k in ("pass_at_1", "pass_at_3", "avg_at_4", "maj_at_4", "accuracy", "n")}
    assert [s for s, _ in history["pass_at_3"]] == [1]  # every step but the last (the run ends there)
    assert history["n"] == [(1, 2.0)] and history["accuracy"] == history["avg_at_4"] == history["pass_at_1"]
    assert 0.0 <= history["maj_at_4"][0][1] <= history["pass_at_3"][0][1] <= 1.0
    assert (tmp_path / "r" / "best").is_dir()  # the checkpoint chosen on validation accuracy (avg@4 here)
