"""Selection across processes: two ranks decide exactly what one process decides and train the same weights, and a
run with a history-keeping selector killed with SIGKILL and resumed (resume=auto) repeats the uninterrupted run's
selections and weights, because the per-question history travels in the checkpoint."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kit import ended, final_params, finish, records, start

THIRDS = [
    "task=thirds", "task.size=6", "algo=grpo", "pruner=topk", "pruner.rate=0.5", "pruner.scope=group",
    "train.group_size=4", "train.max_completion_length=8", "optim.lr=1e-2", "optim.warmup_ratio=0",
    "eval.before_and_after=false",
]
SELECTED = ("select/considered", "select/skipped", "select/screened_out", "select/completions",
            "select/tokens_saved_est")


@pytest.mark.slow
def test_two_ranks_select_and_train_exactly_what_one_process_does(tiny_model_path, tmp_path):
    # backend.batch_size=2 with n_screen=2 and G-n_screen=2: one prompt per generate call, so a prompt's samples
    # depend on its index in the phase only, not on the rank that generated it.
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", "tracker=none", "plugins=[gpo_thirds,gpo_probe]",
            *THIRDS, "selector=screen", "selector.n_screen=2", "allocator=static", "train.questions_per_step=6",
            "train.steps=2", "train.micro_batch_size=2", "backend.batch_size=2",
            "optim.lr=1e-3"]  # as in test_multiprocess: at 1e-2 Adam magnifies float noise in near-zero gradients
    one = start([*base, "run_name=one"], tmp_path / "one.jsonl")
    two = start([*base, "run_name=two", "engine=ddp", "engine.num_processes=2"], tmp_path / "two.jsonl")
    finish(one)
    finish(two)
    single = [r["metrics"] for r in records(tmp_path / "one.jsonl", "step")]
    ranks = {rank: [r["metrics"] for r in records(tmp_path / "two.jsonl", "step") if r["rank"] == rank]
             for rank in (0, 1)}
    assert len(single) == len(ranks[0]) == len(ranks[1]) == 2
    for step in range(2):
        for key in SELECTED:  # decided from all-gathered rewards: the same on both ranks and in one process
            assert ranks[0][step][key] == ranks[1][step][key] == single[step][key], key
    assert single[0]["select/screened_out"] >= 4  # the 4 foreseeable questions of 6 were screened out
    p1 = load_file(str(tmp_path / "one/final/model.safetensors"))
    p2 = load_file(str(tmp_path / "two/final/model.safetensors"))
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], atol=1e-5, rtol=0, msg=name)
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    assert max(float((p1[n] - initial[n]).abs().max()) for n in p1) > 1e-4  # it did train on the continued groups


def selector_state(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step-{step:07d}" / "trainer_state.json").read_text())["selector"]


def selected(run_dir: Path) -> dict[int, dict[str, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    out: dict[int, dict[str, float]] = {}
    for run in client.search_runs(client.get_experiment_by_name("gpo").experiment_id):  # killed, then resumed
        for key in (*SELECTED, "select/p_hard", "loss/total"):
            for m in client.get_metric_history(run.info.run_id, key):
                out.setdefault(m.step, {})[key] = m.value
    return out


@pytest.mark.slow
def test_sigkill_and_resume_repeats_the_selections_and_weights(tiny_model_path, tmp_path):
    # GRESO on a 6-question pool: every question is drawn again by step 2, so skips depend on the streaks and the
    # adapted p_easy/p_hard that the checkpoint carries.
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", "plugins=[gpo_thirds,gpo_faults]", *THIRDS,
            "selector=greso", "allocator=dynamic", "train.questions_per_step=2", "train.micro_batch_size=4",
            "train.steps=5", "checkpoint.every=1", "checkpoint.keep_last=5", "tracker=mlflow"]
    straight = start([*base, "run_name=straight"])  # beside the victim (one core each), not before it
    # The victim SIGKILLs itself in step 3 (gpo_faults), after the checkpoint of step 2, on any machine.
    victim = start([*base, "run_name=killed"], env={"GPO_FAULT_KILL": "0:3"})
    status, out = ended(victim)
    assert status == -signal.SIGKILL and "gpo_faults: rank 0 kills itself in step 3" in out, out[-4000:]
    assert (tmp_path / "killed" / "checkpoints" / "step-0000002" / "trainer_state.json").is_file()
    assert not (tmp_path / "killed" / "final").exists(), "the run must really have been killed before the end"
    out = finish(start([*base, "run_name=killed", "resume=auto"]))
    assert "resumed from" in out
    finish(straight)

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert selector_state(killed, 5) == selector_state(straight, 5)
    assert selector_state(straight, 5)["streaks"], "no streak formed: the test would not exercise history"
    expected, got = selected(straight), selected(killed)
    assert set(expected) == {1, 2, 3, 4, 5} and {3, 4, 5} <= set(got)
    for step in got:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step
    assert sum(expected[s]["select/skipped"] for s in expected) > 0, "nothing was skipped: history never mattered"
    for name, value in final_params(straight).items():
        torch.testing.assert_close(final_params(killed)[name], value, atol=1e-6, rtol=0)
