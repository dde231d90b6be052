"""Faults during a run: a rank of a 2-process run killed or hung mid-step, damaged checkpoints, a reward function
that raises. Each ends in a clear message within a bounded time, and resume=auto continues exactly."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from gpo import checkpoint
from gpo.config import compose
from gpo.errors import UserError
from gpo.tasks.math import Math, MathConfig
from kit import MULTI_RANK, ended, final_params, finish, plugins_importable, start

plugins_importable()  # gpo_toy for the runs in this process

# 3 steps with a checkpoint after each; a fault in step 3 leaves step-0000001 and step-0000002 behind.
TWO_RANKS = [*MULTI_RANK, "plugins=[gpo_toy,gpo_probe,gpo_faults]", "train.steps=3", "checkpoint.every=1",
             "tracker=none", "engine=ddp", "engine.num_processes=2"]
LOST_PEER = "a collective operation with the other ranks failed"


@pytest.mark.slow
def test_killed_rank_stops_the_other_and_resume_reproduces_the_uninterrupted_run(tiny_model_path, tmp_path):
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", *TWO_RANKS]
    straight = start([*base, "run_name=straight"], tmp_path / "straight.jsonl")
    killed = start([*base, "run_name=killed"], tmp_path / "killed.jsonl", env={"GPO_FAULT_KILL": "1:3"})
    finish(straight)
    status, out = ended(killed)

    assert status != 0 and "gpo_faults: rank 1 kills itself in step 3" in out, out[-6000:]
    # The survivor names the failure and how to continue, instead of a traceback or a hang.
    assert f"rank 0 of 2: {LOST_PEER}" in out, out[-4000:]
    assert "rerun the same command with resume=auto run_name=killed" in out
    assert "internal error" not in out
    assert "the 2-process run failed" in out  # the launcher's line
    checkpoints = tmp_path / "killed" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == [
        "step-0000001", "step-0000002"]
    assert not (tmp_path / "killed" / "final").exists()

    out = finish(start([*base, "run_name=killed", "resume=auto"], tmp_path / "resumed.jsonl"))
    assert f"resumed from {checkpoints / 'step-0000002'} at step 2" in out
    expected, got = final_params(tmp_path / "straight"), final_params(tmp_path / "killed")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow
def test_hung_rank_fails_the_other_after_the_collective_timeout(tiny_model_path, tmp_path):
    # The survivor's message names the timeout it waited (60 s, not torch's 30 minutes). The timeout bounds every
    # collective from the rendezvous on, so it is far above how far two healthy ranks drift apart on a busy machine.
    args = [f"model={tiny_model_path}", f"output_dir={tmp_path}", *TWO_RANKS, "run_name=hung",
            "engine.collective_timeout_s=60"]
    status, out = ended(start(args, tmp_path / "hung.jsonl", env={"GPO_FAULT_HANG": "1:3"}))
    assert status != 0 and "gpo_faults: rank 1 hangs in step 3" in out, out[-6000:]
    assert f"rank 0 of 2: {LOST_PEER} (Timed out waiting 60000ms" in out, out[-4000:]
    assert "internal error" not in out


# --- damaged checkpoints (one process, in this process) ---------------------------------------------------------

ONE_PROCESS = [
    "tracker=none", "task=toy", "plugins=[gpo_toy]", "algo=grpo", "pruner=topk", "pruner.rate=0.5",
    "allocator=dynamic", "train.steps=3", "train.questions_per_step=2", "train.group_size=4",
    "train.max_completion_length=8", "train.micro_batch_size=4", "optim.lr=1e-2", "optim.warmup_ratio=0",
    "eval.before_and_after=false", "checkpoint.every=1", "checkpoint.keep_last=3", "run_name=run",
]


def run_in_process(tiny_model_path: str, tmp_path: Path, *extra: str) -> None:
    from gpo.engine import Engine

    Engine(compose([f"model={tiny_model_path}", f"output_dir={tmp_path}", *ONE_PROCESS, *extra])).run()


@pytest.mark.slow
def test_damaged_newest_checkpoint_resumes_from_the_previous_one(tiny_model_path, tmp_path, capsys):
    from gpo.engine import Engine

    run_dir = tmp_path / "run"
    run_in_process(tiny_model_path, tmp_path)
    uninterrupted = final_params(run_dir)
    newest, previous = run_dir / "checkpoints" / "step-0000003", run_dir / "checkpoints" / "step-0000002"

    def resume_and_compare() -> str:
        shutil.rmtree(run_dir / "final")
        capsys.readouterr()
        run_in_process(tiny_model_path, tmp_path, "resume=auto")
        out = capsys.readouterr().out
        assert f"resumed from {previous} at step 2" in out, out
        got = final_params(run_dir)
        for name in uninterrupted:
            torch.testing.assert_close(got[name], uninterrupted[name], atol=1e-6, rtol=0, msg=name)
        return out

    # 1. Truncated (a full disk, a copy cut short): the manifest's sizes catch it before anything is loaded.
    model_file = newest / "pytorch_model.bin"
    size = model_file.stat().st_size
    with open(model_file, "r+b") as f:
        f.truncate(size // 2)
    assert checkpoint.problems(newest) == [f"pytorch_model.bin has {size // 2} bytes, {size} were written"]
    out = resume_and_compare()
    assert (f"checkpoint {newest} is incomplete (pytorch_model.bin has {size // 2} bytes, {size} were written); "
            f"skipped, left in place") in out
    aside = run_dir / "checkpoints" / "step-0000003.incomplete"  # never deleted: moved aside when step 3 came again
    assert (aside / "pytorch_model.bin").stat().st_size == size // 2
    assert checkpoint.problems(newest) == []  # the re-run wrote a new, complete step 3

    # 2. Garbage of the right size: the manifest passes, loading fails, the previous one is loaded instead.
    optimizer_file = newest / "optimizer.bin"
    optimizer_file.write_bytes(b"\0" * optimizer_file.stat().st_size)
    out = resume_and_compare()
    assert f"could not load checkpoint {newest} (" in out
    assert "marked damaged, left in place; trying the previous one" in out
    assert (run_dir / "checkpoints" / "step-0000003.incomplete-2" / checkpoint.DAMAGED).is_file()

    # 3. A damaged checkpoint named explicitly is refused, pointing at the newest complete one.
    with open(newest / "optimizer.bin", "r+b") as f:
        f.truncate(10)
    engine = Engine(compose([f"model={tiny_model_path}", f"output_dir={tmp_path}", *ONE_PROCESS,
                             f"resume={newest}"]))
    with pytest.raises(UserError, match=rf"the checkpoint is incomplete \(optimizer.bin has 10 bytes, .* The "
                                        rf"newest complete one beside it is {previous}"):
        engine.resume_path()


# --- a math-verify worker killed mid-item ---------------------------------------------------------------------


def test_killed_verify_worker_is_replaced_and_its_item_scores_zero_and_counts(monkeypatch):
    from gpo.tasks import math as math_task

    def boxed(answer: str) -> str:
        return f"<think>work</think>\n<answer>\\boxed{{{answer}}}</answer>"

    # The worker is killed the moment it is handed the 100 KB of braces, so it dies holding the item whatever the
    # machine's speed; its own limit is far off, so only noticing the death can end the item early.
    hand_over = math_task._Worker.assign

    def assign_then_kill(worker, index, jobs):
        hand_over(worker, index, jobs)
        if jobs[index][1].startswith("{"):
            os.kill(worker.process.pid, signal.SIGKILL)

    task = Math(MathConfig(workers=1, verify_timeout_s=60.0))
    try:
        assert task.reward([boxed("1")], [{"gold": "1"}]).components["accuracy"] == [2.0]  # worker up and ready
        (victim,) = task._pool.worker_pids()
        monkeypatch.setattr(math_task._Worker, "assign", assign_then_kill)
        rewards = task.reward([boxed("{" * 50_000 + "}" * 50_000), boxed("3")], [{"gold": "1"}, {"gold": "3"}])
        assert rewards.components["accuracy"] == [0.0, 2.0]  # the replacement verified the next item
        assert rewards.metrics["verify_workers_lost"] == 1 and rewards.metrics["verify_failures"] == 1
        assert rewards.metrics["verify_timeouts"] == 0  # noticed as a death, not waited out as a timeout
        assert task._pool.backstops == {"cpu": 0, "wall": 0}
        assert task._pool.worker_pids() != [victim]
        again = task.reward([boxed("2")], [{"gold": "2"}])  # the run goes on
        assert again.components["accuracy"] == [2.0] and again.metrics["verify_failures"] == 0
    finally:
        task.close()


# --- the survivor's message -----------------------------------------------------------------------------------


def test_a_failed_collective_becomes_one_message_and_other_errors_pass_through(monkeypatch):
    from gpo.distributed import PeerLost, peer_failures_explained

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    gloo = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:32478: Connection "
            "reset by peer. This is typically caused by a remote worker hanging. GLHF!")
    with pytest.raises(PeerLost) as caught, peer_failures_explained(lambda: "Rerun with resume=auto."):
        raise RuntimeError(gloo)
    assert str(caught.value).startswith("rank 0 of 2: a collective operation with the other ranks failed (Read "
                                        "error [127.0.0.1]:32478: Connection reset by peer). Another rank")
    assert str(caught.value).endswith("Rerun with resume=auto.") and isinstance(caught.value, UserError)
    with pytest.raises(RuntimeError, match="^shape mismatch$"), peer_failures_explained(lambda: ""):
        raise RuntimeError("shape mismatch")  # a bug stays a bug, with its traceback


def test_collective_timeout_must_be_positive():
    from gpo.config import compose

    with pytest.raises(UserError, match="`engine.collective_timeout_s` must be > 0"):
        compose(["tracker=none", "engine.collective_timeout_s=0"])


def _name_worker(rank, port, out_dir):
    from gpo.distributed import from_rank_zero

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        Path(out_dir, f"rank{rank}").write_text(from_rank_zero(f"run-started-by-rank-{rank}"))
    finally:
        torch.distributed.destroy_process_group()


def test_every_rank_takes_rank_zeros_run_name(tmp_path):
    # A default run name holds the time each rank computed it. Ranks that started a second apart would each write
    # into their own run folder: rank 1's RNG state outside rank 0's checkpoint, which a resume then loses without
    # a word (Accelerate only logs "Could not load random states"). The engine takes rank 0's name.
    import torch.multiprocessing as mp

    from gpo.distributed import from_rank_zero
    from kit import free_port

    assert from_rank_zero("alone") == "alone"
    mp.spawn(_name_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["run-started-by-rank-0"] * 2
