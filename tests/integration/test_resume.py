"""A run killed with SIGKILL and resumed ends with the same parameters and metrics as an uninterrupted run;
MLflow holds what the engine logged; Ctrl-C leaves a checkpoint behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

PLUGINS = Path(__file__).parents[1] / "plugins"
COMMON = [
    "task=toy", "plugins=[gpo_toy]", "algo=grpo", "pruner=topk", "pruner.rate=0.5", "allocator=dynamic",
    "train.steps=4", "train.questions_per_step=2", "train.group_size=4", "train.max_completion_length=8",
    "train.micro_batch_size=4", "optim.lr=1e-2", "optim.warmup_ratio=0", "eval.before_and_after=false",
    "checkpoint.every=1", "checkpoint.keep_last=2",
]


def gpo(args: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{PLUGINS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "gpo", "run", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final" / "model.safetensors"))


def step_metrics(run_dir: Path) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs(client.get_experiment_by_name("gpo").experiment_id)
    history = [m for run in runs for m in client.get_metric_history(run.info.run_id, "loss/total")]
    return {m.step: m.value for m in history}


class Straight:
    """The uninterrupted 4-step MLflow run: started once, in the background, read by two tests."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path) -> None:
        self.proc, self.run_dir, self.out = proc, run_dir, None

    def finished(self) -> Path:
        if self.out is None:
            self.out, _ = self.proc.communicate(timeout=300)
        assert self.proc.returncode == 0, self.out
        return self.run_dir


@pytest.fixture(scope="module")
def straight(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    run = Straight(gpo([f"model={tiny_model_path}", f"output_dir={out}", *COMMON, "run_name=straight",
                        "tracker=mlflow"]), out / "straight")
    yield run
    if run.proc.poll() is None:  # a test failed before waiting for it
        run.proc.kill()
        run.proc.wait()


@pytest.mark.slow
def test_sigkill_and_resume_reproduces_the_uninterrupted_run(straight, tiny_model_path, tmp_path):
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", *COMMON]
    # The victim starts beside the uninterrupted run (one core each) rather than after it.
    victim = gpo([*base, "run_name=killed", "tracker=mlflow"], start_new_session=True)
    marker = tmp_path / "killed" / "checkpoints" / "step-0000002" / "trainer_state.json"
    deadline = time.time() + 240
    while not marker.exists():
        assert victim.poll() is None, victim.communicate()[0]
        assert time.time() < deadline, "no checkpoint after step 2"
        time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert not (tmp_path / "killed" / "final").exists(), "the run must really have been killed before the end"

    out = finish(gpo([*base, "run_name=killed", "tracker=mlflow", "resume=auto"]))
    assert "resumed from" in out

    straight_dir = straight.finished()
    uninterrupted, resumed = params(straight_dir), params(tmp_path / "killed")
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
    proc = gpo([f"model={tiny_model_path}", f"output_dir={tmp_path}", *COMMON, "run_name=stopped",
                "tracker=none", "checkpoint.every=0", "train.steps=200"],
               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not (tmp_path / "stopped" / "config.yaml").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.2)
    time.sleep(3)  # inside the training loop
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "interrupted: saved" in out
    assert list((tmp_path / "stopped" / "checkpoints").glob("step-*/trainer_state.json"))
