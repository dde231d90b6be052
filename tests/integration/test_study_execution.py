"""`gpo study` execution: runs at once (study.parallel), continuing a study (study.resume), on the tiny model."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from gpo import cli
from gpo.errors import UserError
from gpo.study import plan

sys.path.insert(0, str(Path(__file__).parents[1] / "plugins"))


def _args(tiny_model_path: str, tmp_path: Path, *more: str) -> list[str]:
    return [f"model={tiny_model_path}", f"output_dir={tmp_path}", "plugins=[gpo_flaky]", "task=flaky",
            "tracker=mlflow", "algo=grpo", "pruner=none", "allocator=static", "train.steps=1",
            "train.questions_per_step=1", "train.group_size=2", "train.max_completion_length=4", "eval.limit=2",
            "eval.batch_size=2", "eval.max_new_tokens=2", "checkpoint.save_final_model=false", *more]


@pytest.mark.slow
def test_parallel_runs_and_resume_reruns_only_what_did_not_finish(tiny_model_path, tmp_path, capsys):
    marker = tmp_path / "fail-now"
    marker.touch()
    # run 1 trains; run 2 fails while the marker exists (at start-up, long before run 1 ends)
    args = _args(tiny_model_path, tmp_path, f"task.marker={tmp_path / 'never'},{marker}", "study.parallel=2")
    assert cli.main(["study", *args]) == 0
    out = capsys.readouterr().out
    # both ran at once: the quick failure of run 2 is reported before run 1 finishes
    assert out.index("run 2/2") < out.index("run 1/2"), out
    (study_dir,) = tmp_path.glob("study-*")
    first = list(csv.DictReader(open(study_dir / "study.csv")))
    assert [r["status"] for r in first] == ["FINISHED", "FAILED"]
    assert "RuntimeError: flaky" in first[1]["error"]
    finished_dir = next(study_dir.glob("01-*"))
    assert (finished_dir / "study.log").is_file() and not (finished_dir / "checkpoints").exists()  # deleted

    marker.unlink()
    assert cli.main(["study", f"study.resume={study_dir}"]) == 0
    out = capsys.readouterr().out
    assert "resuming: 1 finished runs kept, 1 to run" in out
    again = list(csv.DictReader(open(study_dir / "study.csv")))
    assert [r["status"] for r in again] == ["FINISHED", "FINISHED"]
    assert again[0]["run_id"] == first[0]["run_id"]  # kept, not re-run
    assert again[1]["run_id"] != first[1]["run_id"]
    assert len(list(study_dir.glob("02-*.attempt-1"))) == 1  # the failed attempt's directory is kept aside

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{study_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("gpo").experiment_id])
    assert len(runs) == 3  # the parent and two children: the failed attempt's MLflow run was deleted
    (parent,) = [r for r in runs if r.data.tags.get("gpo_study_role") == "parent"]
    assert parent.info.status == "FINISHED"

    # nothing left to do: a second resume runs nothing and rebuilds the same table
    assert cli.main(["study", f"study.resume={study_dir}"]) == 0
    assert "resuming: 2 finished runs kept, 0 to run" in capsys.readouterr().out
    assert list(csv.DictReader(open(study_dir / "study.csv"))) == again
    # and `gpo report PARENT` rebuilds it from MLflow alone
    assert cli.main(["report", parent.info.run_id, "--tracking-uri", str(study_dir), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "study.csv").read_text() == (study_dir / "study.csv").read_text()


def test_resume_needs_a_study_directory_and_no_other_arguments(tmp_path, capsys):
    with pytest.raises(UserError, match="not a study directory"):
        from gpo.study import study_from_args

        study_from_args([f"study.resume={tmp_path}"])
    (tmp_path / "study-args.json").write_text('{"args": [], "config_files": [], "baseline": null}')
    assert cli.main(["study", f"study.resume={tmp_path}", "algo=dapo"]) == 2
    assert "with the arguments it was started with" in capsys.readouterr().err
    f = tmp_path / "resume.yaml"
    f.write_text(f"study:\n  resume: {tmp_path}\n")
    assert cli.main(["study", "task=toy", "plugins=[gpo_toy]", "--config", str(f)]) == 2
    assert "give it on the command line" in capsys.readouterr().err
    assert cli.main(["study", "task=toy", "plugins=[gpo_toy]", "study.parallel=0"]) == 2
    assert "`study.parallel` must be >= 1" in capsys.readouterr().err
    assert cli.main(["study", "task=toy", "plugins=[gpo_toy]", "study.launcher=slurm"]) == 2
    assert "`study.launcher` must be one of local, ray" in capsys.readouterr().err


# --- pieces of the runner, without training -----------------------------------------------------------------------


def test_a_multi_rank_run_gets_a_config_file_that_composes_back_to_itself(tmp_path):
    """Runs with engine.num_processes > 1 go through `gpo run --config FILE` on every rank."""
    from gpo.config import compose, layer_yaml

    p = plan(["pruner=none", "algo=dapo", "engine.num_processes=2", "task=toy", "plugins=[gpo_toy]"])
    cfg = p.runs[0].cfg
    f = tmp_path / "run.yaml"
    f.write_text(layer_yaml(cfg))
    assert compose([], [f]) == cfg  # pruner none, not base's topk


def test_runs_at_once_each_get_their_own_gpus(monkeypatch, tmp_path):
    """study.parallel=3 on a machine with 2 GPUs and 1 GPU per run: never more than 2 at once, never sharing one."""
    import threading
    from types import SimpleNamespace

    from gpo.study import runner
    from kit import HANG_S

    active, seen, lock = set(), [], threading.Lock()
    # The first two runs hold their GPU until both run at once (a pool that ran one at a time would break the
    # barrier after HANG_S); the third can only start once one of them has given its GPU back.
    both = threading.Barrier(2, timeout=HANG_S)

    def fake_run_child(cfg, run_dir, devices=None, sys_path=None):
        with lock:
            assert devices is not None and len(devices) == 1 and not active & set(devices)
            active.update(devices)
            seen.append((cfg.run_name, tuple(devices), len(active)))
            first_two = len(seen) <= 2
        if first_two:
            both.wait()
        with lock:
            active.difference_update(devices)
        return runner.Outcome("FINISHED", "", None, None), run_dir / "study.log"

    monkeypatch.setattr(runner, "run_child", fake_run_child)
    monkeypatch.setattr(runner, "_cuda_devices", lambda: 2)
    runs = [SimpleNamespace(index=i) for i in (1, 2, 3)]
    configs = {i: SimpleNamespace(run_name=f"run-{i}", engine=SimpleNamespace(num_processes=1)) for i in (1, 2, 3)}
    options = SimpleNamespace(launcher="local", parallel=3)
    done = list(runner._execute(runs, configs, options, tmp_path))
    assert sorted(r.index for r, _, _ in done) == [1, 2, 3]
    assert max(n for _, _, n in seen) == 2  # the third run waited for a free GPU
    configs[1].engine.num_processes = 3
    with pytest.raises(UserError, match="needs 3 GPUs .* shows 2"):
        list(runner._execute(runs, configs, options, tmp_path))


@pytest.mark.slow
def test_a_multi_rank_run_of_a_study_goes_through_gpo_run(tiny_model_path, tmp_path):
    args = [a for a in _args(tiny_model_path, tmp_path) if not a.startswith(("task=", "train.questions_per_step="))]
    assert cli.main(["study", *args, "task=toy", "engine.num_processes=2", "train.questions_per_step=2"]) == 0
    (study_dir,) = tmp_path.glob("study-*")
    (row,) = list(csv.DictReader(open(study_dir / "study.csv")))
    assert row["status"] == "FINISHED" and float(row["train_s"]) > 0, row
    log = next(study_dir.glob("01-*/study.log")).read_text()
    assert "launching 2 processes" in log and "-m gpo run --config" in log
    assert float(row["peak_rss_mb"]) > 100  # the largest rank's peak, not the launcher's


def _fake_child(calls: list[str], fail_with: str = ""):
    from gpo.study import runner

    def run_child(cfg, run_dir, devices=None, sys_path=None):
        calls.append(cfg.run_name)
        run_dir.mkdir(parents=True, exist_ok=True)
        if fail_with:
            return runner.Outcome("FAILED", fail_with, None, None), run_dir / "study.log"
        return runner.Outcome("FINISHED", "", 100.0, None), run_dir / "study.log"

    return run_child


def test_a_run_that_fills_the_disk_stops_the_study_with_a_resume_hint(monkeypatch, tiny_model_path, tmp_path, capsys):
    """A run that dies of a full disk would make every later run die the same way: the study stops (exit 2, no
    traceback) and says how to continue."""
    from gpo.study import runner

    calls: list[str] = []
    monkeypatch.setattr(runner, "run_child", _fake_child(calls, "OSError: [Errno 28] No space left on device"))
    assert cli.main(["study", *_args(tiny_model_path, tmp_path, "optim.lr=1e-5,2e-5,3e-5")]) == 2
    err = capsys.readouterr().err
    assert len(calls) == 1  # runs 2 and 3 were never started
    assert "the disk is full" in err and "1 of 3 runs recorded" in err and "Traceback" not in err
    study_dir = next(tmp_path.glob("study-*"))
    assert f"gpo study study.resume={study_dir}" in err
    assert (study_dir / "study.md").is_file()  # the report of what was recorded still went out


def test_a_full_disk_under_mlflow_keeps_the_finished_runs_for_resume(monkeypatch, tiny_model_path, tmp_path, capsys):
    """SQLite's "database or disk is full" arrives wrapped by SQLAlchemy and MLflow, and the report written after
    it fails too: the user gets the one clear error, and `study.resume` runs only what was not recorded."""
    import sqlite3

    from mlflow.exceptions import MlflowException

    from gpo.study import runner

    calls: list[str] = []
    record = runner._record

    def record_until_full(*a, **k):
        if len(calls) >= 2:
            try:
                raise sqlite3.OperationalError("database or disk is full")
            except sqlite3.OperationalError as exc:
                raise MlflowException("(sqlite3.OperationalError) database or disk is full") from exc
        return record(*a, **k)

    def report_on_full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner, "run_child", _fake_child(calls))
    monkeypatch.setattr(runner, "_record", record_until_full)
    monkeypatch.setattr(runner, "write_outputs", report_on_full_disk)
    assert cli.main(["study", *_args(tiny_model_path, tmp_path, "optim.lr=1e-5,2e-5,3e-5")]) == 2
    out, err = capsys.readouterr()
    assert "1 of 3 runs recorded" in err and "Traceback" not in err
    assert "tables were not written: the disk is full" in out

    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(runner, "run_child", _fake_child(calls))
    study_dir = next(tmp_path.glob("study-*"))
    assert cli.main(["study", f"study.resume={study_dir}"]) == 0
    assert "1 finished runs kept, 2 to run" in capsys.readouterr().out
    assert [c[:2] for c in calls] == ["02", "03"]
    with open(study_dir / "study.csv") as f:
        assert len(list(csv.DictReader(f))) == 3


def test_a_full_disk_while_writing_the_tables_of_a_finished_study_is_a_user_error(monkeypatch, tiny_model_path,
                                                                                 tmp_path, capsys):
    """Every run recorded, then the report hits the full disk: exit 2 with the resume hint, not a traceback over
    the study.md that was never written."""
    from gpo.study import runner

    def report_on_full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner, "run_child", _fake_child([]))
    monkeypatch.setattr(runner, "write_outputs", report_on_full_disk)
    assert cli.main(["study", *_args(tiny_model_path, tmp_path, "optim.lr=1e-5,2e-5")]) == 2
    err = capsys.readouterr().err
    assert "the disk is full" in err and "2 of 2 runs recorded" in err and "Traceback" not in err
