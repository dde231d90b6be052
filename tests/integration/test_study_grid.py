"""A real `gpo study` on the tiny model: 3 combinations x 2 steps, one failing, tracked in MLflow, its table and plots
rebuilt by `gpo report` (planning and the table's arithmetic: tests/unit/test_study.py)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from gpo import cli
from gpo.study import TAG_ROLE, report
from kit import assert_png

sys.path.insert(0, str(Path(__file__).parents[1] / "plugins"))
TOY = ["task=toy", "plugins=[gpo_toy]"]


@pytest.mark.slow
def test_study_runs_the_grid_reports_a_failure_and_report_reproduces_it(tiny_model_path, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    args = [
        f"model={tiny_model_path}", f"output_dir={tmp_path}", *TOY, "tracker=mlflow", "algo=grpo",
        "allocator=static", "train.steps=2", "train.questions_per_step=2", "train.group_size=4",
        "train.max_completion_length=8", "train.micro_batch_size=8", "eval.limit=2", "eval.batch_size=2",
        "eval.max_new_tokens=4",
        # none runs once (rate does not apply to it); topk at 0.5 trains; the test plug-in `refusing` passes the
        # composer and fails in its run, when the pruner is built
        "pruner=none,topk,refusing", "pruner.rate=0.5", "study.keep_checkpoints=true",
    ]
    assert cli.main(["study", *args]) == 0
    out = capsys.readouterr().out
    assert "study of 3 runs" in out
    (study_dir,) = tmp_path.glob("study-*")
    assert (next(study_dir.glob("01-*")) / "checkpoints").is_dir()  # kept, as asked (deleted by default)

    rows = list(csv.DictReader(open(study_dir / "study.csv")))
    assert [(r["run"], r["combination"], r["status"]) for r in rows] == [
        ("1", "pruner=none", "FINISHED"), ("2", "pruner=topk", "FINISHED"),
        ("3", "pruner=refusing", "FAILED")]
    none, topk, failed = rows
    assert failed["error"].startswith("UserError: the refusing pruner refuses"), failed["error"]
    for row in (none, topk):
        assert 0.0 <= float(row["acc_before"]) <= 1.0 and 0.0 <= float(row["acc_after"]) <= 1.0
        assert float(row["train_s"]) > 0 and float(row["peak_rss_mb"]) > 100  # a process holding torch
        assert float(row["tokens_trained"]) <= float(row["tokens_generated"])
    assert float(none["speedup"]) == 1.0
    assert float(topk["speedup"]) == pytest.approx(float(none["train_s"]) / float(topk["train_s"]))
    assert float(none["kept_frac"]) == 1.0 and float(topk["kept_frac"]) == 0.5  # G=4, rate 0.5: 2 of 4 kept
    assert failed["speedup"] == ""
    for name in ("reward_vs_time.png", "accuracy_vs_speedup.png"):
        assert_png(study_dir / name)

    uri = f"sqlite:///{study_dir / 'mlflow.db'}"
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("gpo").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get(TAG_ROLE) == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_id for r in children) == sorted(r["run_id"] for r in rows)
    assert parent.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"study.csv", "study.md", "reward_vs_time.png", "accuracy_vs_speedup.png"} <= artifacts
    # The child runs hold what the engine logged: the table's train time is their per-step times summed.
    history = client.get_metric_history(topk["run_id"], "time/step")
    assert len(history) == 2 and sum(m.value for m in history) == pytest.approx(float(topk["train_s"]))

    # gpo report, from the child ids or from the parent id alone, rebuilds the same table.
    study_csv = (study_dir / "study.csv").read_text()
    assert cli.main(["report", *[r["run_id"] for r in rows], "--tracking-uri", uri, "--out",
                     str(tmp_path / "by-ids")]) == 0
    assert (tmp_path / "by-ids" / "study.csv").read_text() == study_csv
    report([parent.info.run_id], tracking_uri=str(study_dir), out_dir=tmp_path / "by-parent")
    assert (tmp_path / "by-parent" / "study.csv").read_text() == study_csv
    for name in ("reward_vs_time.png", "accuracy_vs_speedup.png"):
        assert_png(tmp_path / "by-parent" / name)
