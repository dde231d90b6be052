"""`study.launcher=ray`: a study's runs as Ray tasks on a local `ray.init()` cluster (CPU). Skipped without Ray
(`pip install 'gpo[ray]'`)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from gpo import cli

sys.path.insert(0, str(Path(__file__).parents[1] / "plugins"))


@pytest.mark.slow
def test_a_study_runs_each_run_as_a_ray_task(tiny_model_path, tmp_path, capsys):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # a local cluster on this machine's CPUs
    try:
        args = [f"model={tiny_model_path}", f"output_dir={tmp_path}", "plugins=[gpo_flaky]", "task=flaky",
                # the task refuses to train outside a Ray worker: only the Ray launcher can finish these runs
                "task.need_env=RAY_RAYLET_PID",
                "tracker=mlflow", "algo=grpo", "allocator=static", "train.steps=1", "train.questions_per_step=1",
                "train.group_size=2", "train.max_completion_length=4", "eval.limit=2", "eval.batch_size=2",
                "eval.max_new_tokens=2", "checkpoint.save_final_model=false", "pruner=none,topk",
                "pruner.rate=0.5", "study.launcher=ray"]
        assert cli.main(["study", *args]) == 0
    finally:
        ray.shutdown()
    (study_dir,) = tmp_path.glob("study-*")
    rows = list(csv.DictReader(open(study_dir / "study.csv")))
    assert [(r["combination"], r["status"]) for r in rows] == [("pruner=none", "FINISHED"), ("pruner=topk", "FINISHED")]
    assert float(rows[1]["kept_frac"]) == 0.5 and float(rows[0]["speedup"]) == 1.0


def test_the_local_launcher_cannot_finish_those_runs(tiny_model_path, tmp_path, monkeypatch):
    """The check above means something: without Ray the same run fails on the missing variable."""
    from gpo.config import compose
    from gpo.engine import train

    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    cfg = compose([f"model={tiny_model_path}", f"output_dir={tmp_path}", "plugins=[gpo_flaky]", "task=flaky",
                   "task.need_env=RAY_RAYLET_PID", "tracker=none"])
    with pytest.raises(RuntimeError, match="RAY_RAYLET_PID is not set"):
        train(cfg)


def test_without_ray_the_launcher_is_a_user_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert cli.main(["study", "task=toy", "plugins=[gpo_toy]", "study.launcher=ray", f"output_dir={tmp_path}"]) == 2
    assert "pip install 'gpo[ray]'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before any study directory was made
