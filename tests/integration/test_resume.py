"""A run killed with SIGKILL and resumed ends with the same parameters and metrics as an uninterrupted run;
MLflow holds what the engine logged; Ctrl-C leaves a checkpoint behind."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch

from kit import ended, final_params, finish, kill_run, start, until

# gpo_faults does nothing unless GPO_FAULT_KILL is set, but every run loads it: their configs are the same.
COMMON = [
    "task=toy", "plugins=[gpo_toy,gpo_faults]", "algo=grpo", "pruner=topk", "pruner.rate=0.5", "allocator=dynamic",
    "train.steps=4", "train.questions_per_step=2", "train.group_size=4", "train.max_completion_length=8",
    "train.micro_batch_size=4", "optim.lr=1e-2", "optim.warmup_ratio=0", "eval.before_and_after=false",
    "checkpoint.every=1", "checkpoint.keep_last=2",
]


def step_metrics(run_dir: Path) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs(client.get_experiment_by_name("gpo").experiment_id)
    history = [m for run in runs for m in client.get_metric_history(run.info.run_id, "loss/total")]
    return {m.step: m.value for m in history}


class Straight:
    """The uninterrupted 4-step MLflow run: started once, in the background, read by two tests."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path) -> None:
        self.proc, self.run_dir, self.ended = proc, run_dir, None

    def finished(self) -> Path:
        if self.ended is None:
            self.ended = ended(self.proc)
        status, out = self.ended
        assert status == 0, out[-6000:]
        return self.run_dir


@pytest.fixture(scope="module")
def straight(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    run = Straight(start([f"model={tiny_model_path}", f"output_dir={out}", *COMMON, "run_name=straight",
                          "tracker=mlflow"]), out / "straight")
    yield run
    if run.proc.poll() is None:  # a test failed before waiting for it
        kill_run(run.proc)


@pytest.mark.slow
def test_sigkill_and_resume_reproduces_the_uninterrupted_run(straight, tiny_model_path, tmp_path):
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", *COMMON]
    # The victim starts beside the uninterrupted run (one core each) rather than after it. It SIGKILLs itself in
    # step 3 (gpo_faults), after the checkpoint of step 2, however fast or slow the machine is.
    victim = start([*base, "run_name=killed", "tracker=mlflow"], env={"GPO_FAULT_KILL": "0:3"})
    status, out = ended(victim)
    assert status == -signal.SIGKILL and "gpo_faults: rank 0 kills itself in step 3" in out, out[-4000:]
    assert (tmp_path / "killed" / "checkpoints" / "step-0000002" / "trainer_state.json").is_file()
    assert not (tmp_path / "killed" / "final").exists(), "the run must really have been killed before the end"

    out = finish(start([*base, "run_name=killed", "tracker=mlflow", "resume=auto"]))
    assert "resumed from" in out

    straight_dir = straight.finished()
    uninterrupted, resumed = final_params(straight_dir), final_params(tmp_path / "killed")
    assert uninterrupted.keys() == resumed.keys()
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], atol=1e-6, rtol=0)
    expected, got = step_metrics(straight_dir), step_metrics(tmp_path / "killed")
    assert set(expected) == {1, 2, 3, 4}
    for step in got:  # steps logged before the kill and after the resume
        assert got[step] == pytest.approx(expected[step], abs=1e-6)
    assert {3, 4} <= set(got)
    kept = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert kept == ["step-0000003", "step-0000004"]  # keep_last=2, no temporary directory left over


@pytest.mark.slow
def test_mlflow_run_holds_params_metrics_config_and_final_model(straight):
    """Read from the uninterrupted run above (no run of its own: a `gpo run` process costs ~15 s of a core)."""
    from mlflow.tracking import MlflowClient

    run_dir = straight.finished()
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs(client.get_experiment_by_name("gpo").experiment_id)
    assert run.data.params["algo.name"] == "grpo" and run.data.params["pruner.rate"] == "0.5"
    for key in ("reward/mean", "prune/kept_frac", "loss/total", "train/grad_norm", "train/lr", "time/generate",
                "time/reward", "time/logprobs", "time/update", "tokens/generated", "tokens/trained",
                "completion/length_mean", "zero_std_frac", "kl/mean", "clip/low_frac"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [1, 2, 3, 4], key
    assert run.data.tags["final_model"].endswith("final")
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "config.yaml" in artifacts
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_interrupt_saves_a_checkpoint(tiny_model_path, tmp_path):
    # A job started in the background by a non-interactive shell (how CI scripts often run) inherits SIGINT as
    # ignored, and Python then installs no Ctrl-C handler: give the run the default disposition a terminal has.
    # gpo_probe records each finished step: the first record means the run is inside its training loop, which
    # it cannot leave on its own before the SIGINT (far more steps than could run meanwhile).
    probe = tmp_path / "probe.jsonl"
    proc = start([f"model={tiny_model_path}", f"output_dir={tmp_path}", *COMMON, "plugins=[gpo_toy,gpo_probe]",
                  "run_name=stopped", "tracker=none", "checkpoint.every=0", "train.steps=100000"], probe,
                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    until(lambda: probe.exists() and '"kind": "step"' in probe.read_text(), "first step", proc)
    proc.send_signal(signal.SIGINT)
    status, out = ended(proc)
    assert status == 130, out
    assert "interrupted: saved" in out
    assert list((tmp_path / "stopped" / "checkpoints").glob("step-*/trainer_state.json"))
