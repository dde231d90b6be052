"""The generator/trainer corrections (`correction=`, gpo.corrections): hand-derived weights and masks of every member
at token and sequence level, equivalence with TRL's importance-sampling modes, dropped tokens and rows leaving the
loss's denominators, every objective composed with every correction, and the mismatch metrics' reductions."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gpo import registry
from gpo.corrections.mis import masked_weights
from gpo.corrections.tis import truncated_weights
from gpo.metrics import MetricSums, mismatch_metrics
from gpo.step_math import corrected, loss_shares, step_totals
from gpo.types import RolloutBatch

registry.load_builtins()
LN = math.log

# Two rows, the first one token shorter (its last column is padding). Token ratios rho = pi_old / pi_generator:
#   row 0: 0.8/0.4 = 2,  0.3/0.5 = 0.6,  (padding)          product 1.2
#   row 1: 0.9/0.3 = 3,  0.6/0.4 = 1.5,  0.1/0.4 = 0.25     product 3 * 1.5 * 0.25 = 1.125
TRAINER = torch.tensor([[LN(0.8), LN(0.3), 0.0], [LN(0.9), LN(0.6), LN(0.1)]], dtype=torch.float64)
GENERATOR = torch.tensor([[LN(0.4), LN(0.5), -9.0], [LN(0.3), LN(0.4), LN(0.4)]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
T, F = True, False


def _close(x, expected):
    return torch.allclose(x.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)


def _correct(name, **settings):
    return registry.get("correction", name).build(settings).correct(TRAINER, GENERATOR, MASK)


# --- each member by hand -----------------------------------------------------------------------------------------


def test_none_weighs_every_token_one_and_keeps_all():
    out = _correct("none")
    assert _close(out.weights, [[1, 1, 1], [1, 1, 1]]) and bool(out.mask.all()) and not out.truncated.any()


def test_tis_token_truncates_each_ratio_at_the_cap():
    out = _correct("tis", level="token", cap=2.5)
    # min(rho, 2.5): 2, 0.6 | 3 -> 2.5, 1.5, 0.25; padding weight 1
    assert _close(out.weights, [[2, 0.6, 1], [2.5, 1.5, 0.25]])
    assert out.truncated.tolist() == [[F, F, F], [T, F, F]] and bool(out.mask.all())


def test_tis_sequence_truncates_the_rows_product():
    out = _correct("tis", level="sequence", cap=1.15)
    # row 0: 1.2 -> 1.15 (truncated, every token); row 1: 1.125 < 1.15 stays
    assert _close(out.weights, [[1.15, 1.15, 1], [1.125, 1.125, 1.125]])
    assert out.truncated.tolist() == [[T, T, F], [F, F, F]] and bool(out.mask.all())


def test_mis_token_drops_ratios_outside_the_band_and_weighs_the_rest():
    out = _correct("mis", level="token", lower=0.4, upper=2.5)
    # in [0.4, 2.5]: 2, 0.6 | 1.5 kept with their ratio; 3 and 0.25 dropped (weight 0)
    assert _close(out.weights, [[2, 0.6, 1], [0, 1.5, 0]])
    assert out.mask.tolist() == [[T, T, T], [F, T, F]]
    unweighted = _correct("mis", level="token", lower=0.4, upper=2.5, weighted=False)  # verl's rollout_rs alone
    assert _close(unweighted.weights, [[1, 1, 1], [0, 1, 0]]) and torch.equal(unweighted.mask, out.mask)


def test_mis_sequence_drops_whole_rows():
    out = _correct("mis", level="sequence", lower=0.0, upper=1.15)
    # row 0's product 1.2 > 1.15: every token dropped (its padding stays "kept", outside the loss anyway);
    # row 1's 1.125 is inside: weight 1.125 on each token
    assert _close(out.weights, [[0, 0, 1], [1.125, 1.125, 1.125]])
    assert out.mask.tolist() == [[F, F, T], [T, T, T]]


def test_icepop_masks_tokens_outside_half_to_five():
    out = _correct("icepop")  # [0.5, 5]: only 0.25 leaves it
    assert _close(out.weights, [[2, 0.6, 1], [3, 1.5, 0]])
    assert out.mask.tolist() == [[T, T, T], [T, T, F]] and not out.truncated.any()


def test_long_rows_neither_overflow_nor_underflow():
    trainer, generator = torch.zeros(2, 4000), torch.full((2, 4000), -0.5)  # product e^2000
    generator[1] = 0.5  # product e^-2000
    out = masked_weights(trainer, generator, torch.ones(2, 4000), 0.1, 10.0, level="sequence")
    assert not out.mask.any() and bool(torch.isfinite(out.weights).all())
    assert bool((truncated_weights(trainer, generator, torch.ones(2, 4000), 3.0, "sequence").weights[0] == 3).all())


# --- TRL's modes -----------------------------------------------------------------------------------------------


def trl_importance_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """A transcription of TRL 1.16's GRPOTrainer vLLM importance-sampling ratio (inline in its
    `_generate_and_score_completions`, not importable as a function): shape (B, T) for token modes, (B, 1) for
    sequence modes; *_truncate clamps to [clip_min, clip_max], *_mask sets ratios outside it to 0."""
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.parametrize("mode, name, settings", [
    ("token_truncate", "tis", {"level": "token", "cap": 3.0}),
    ("sequence_truncate", "tis", {"level": "sequence", "cap": 3.0}),
    ("token_mask", "mis", {"level": "token", "lower": 0.0, "upper": 3.0}),  # TRL's clip_min None: lower 0
    ("sequence_mask", "mis", {"level": "sequence", "lower": 0.0, "upper": 3.0}),
    ("token_mask", "mis", {"level": "token", "lower": 0.7, "upper": 1.3}),
])
def test_weights_equal_trls_ratio_on_loss_tokens(mode, name, settings):
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 9, generator=gen, dtype=torch.float64) * 3
    sampling = old + 0.3 * torch.randn(6, 9, generator=gen, dtype=torch.float64)  # mismatch of ~0.3 nats
    mask = (torch.arange(9)[None, :] < torch.tensor([9, 7, 5, 3, 8, 1])[:, None]).long()
    clip_min = settings.get("lower") or None
    trl = trl_importance_ratio(old, sampling, mask, mode, clip_min, 3.0 if name == "tis" else settings["upper"])
    ours = registry.get("correction", name).build(settings).correct(old, sampling, mask)
    m = mask.bool()
    assert torch.allclose(ours.weights.double()[m], trl.expand_as(old)[m], rtol=1e-6)
    if name == "mis":  # TRL keeps zero-weight tokens in its denominators; gpo drops them: the same tokens
        assert torch.equal(~ours.mask & m, (trl.expand_as(old) == 0) & m)
        if settings["lower"] > 0:  # the narrow band bites, but not everywhere
            assert bool((~ours.mask & m).any()) and bool((ours.mask & m).any())


# --- dropped tokens and rows leave the denominators -------------------------------------------------------------


def _batch(mask, generator_logprobs, old_logprobs) -> RolloutBatch:
    n, width = mask.shape
    return RolloutBatch(
        prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
        completion_ids=torch.ones(n, width, dtype=torch.long), completion_mask=mask,
        group_ids=torch.zeros(n, dtype=torch.long), rewards=torch.zeros(n),
        advantages=torch.tensor([1.0, -0.5, 2.0][:n]), truncated=torch.zeros(n, dtype=torch.bool),
        owner_rank=torch.zeros(n, dtype=torch.long), old_logprobs=old_logprobs, generator_logprobs=generator_logprobs,
    )


def _step_loss(objective, batch, logp, correction):
    kept, _ = corrected(correction, objective, batch, batch.old_logprobs)
    totals = step_totals(objective, kept)
    return sum(share for share, _ in loss_shares(objective, kept, logp, micro_batch_size=2, totals=totals)), totals


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_a_dropped_token_counts_as_if_it_were_not_there(aggregation):
    objective = registry.get("algo", "grpo").build({"loss_agg": aggregation, "beta": 0.0}, max_completion_length=8)
    icepop = registry.get("correction", "icepop").build(None)
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    logp = old + 0.1 * torch.randn(3, 4, generator=gen, dtype=torch.float64)  # the policy after a step
    sampled = old.clone()
    sampled[1, 1] = old[1, 1] - LN(10)  # ratio 10 > 5: icepop drops this token, keeps all others with ratio 1
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    with_token, totals = _step_loss(objective, _batch(mask, sampled, old), logp, icepop)
    without = mask.clone()
    without[1, 1] = 0  # the same batch where that token is no loss token at all
    without_token, totals_without = _step_loss(objective, _batch(without, sampled, old), logp, icepop)
    # token_mean: 8 tokens, not 9, in the denominator; seq_mean: row 1's mean over its 3 other tokens
    assert totals == totals_without and totals.tokens == 8 and totals.sequences == 3
    assert with_token.item() == pytest.approx(without_token.item(), rel=1e-12)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_a_dropped_row_counts_as_if_it_were_not_there(aggregation):
    objective = registry.get("algo", "grpo").build({"loss_agg": aggregation, "beta": 0.0}, max_completion_length=8)
    mis = registry.get("correction", "mis").build({"level": "sequence", "upper": 2.0})
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 4, generator=gen, dtype=torch.float64)
    logp = old + 0.1 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    sampled = old.clone()
    sampled[2, 0] = old[2, 0] - LN(3)  # row 2's product of ratios is 3 > 2: the whole row is dropped
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    batch = _batch(mask, sampled, old)
    with_row, totals = _step_loss(objective, batch, logp, mis)
    rest = torch.tensor([True, True, False])
    without_row, totals_without = _step_loss(objective, batch.select(rest), logp[rest], mis)
    assert totals == totals_without and (totals.sequences, totals.tokens) == (2, 7)
    assert with_row.item() == pytest.approx(without_row.item(), rel=1e-12)


# --- every objective with every correction -----------------------------------------------------------------------


@pytest.mark.parametrize("correction", registry.names("correction"))
@pytest.mark.parametrize("algo", registry.names("algo"))
def test_every_objective_composes_with_every_correction(algo, correction):
    objective = registry.get("algo", algo).build(None, max_completion_length=4)
    gen = torch.Generator().manual_seed(2)
    old = -torch.rand(3, 4, generator=gen) * 2
    sampled = old + 0.5 * torch.randn(3, 4, generator=gen)  # large enough that icepop and mis drop some tokens
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    batch = dataclasses.replace(_batch(mask, sampled, old), ref_logprobs=old + 0.05)
    logp = (old + 0.1 * torch.randn(3, 4, generator=gen)).requires_grad_()
    loss, totals = _step_loss(objective, batch, logp, registry.get("correction", correction).build(None))
    loss.backward()
    assert totals.tokens > 0 and torch.isfinite(loss) and bool(torch.isfinite(logp.grad).all())
    assert logp.grad.abs().sum() > 0  # the loss reaches the policy through the kept tokens


# --- metrics -----------------------------------------------------------------------------------------------------


def test_mismatch_metrics_by_hand():
    objective = registry.get("algo", "grpo").build(None, max_completion_length=8)
    batch = _batch(MASK, GENERATOR, TRAINER)
    _, counts = corrected(registry.get("correction", "icepop").build(None), objective, batch, TRAINER)
    m = mismatch_metrics(counts)
    ratios = [2, 0.6, 3, 1.5, 0.25]  # the 5 loss tokens' pi_old / pi_generator
    assert m["mismatch/logp_abs_mean"] == pytest.approx(sum(abs(LN(r)) for r in ratios) / 5)
    assert m["mismatch/logp_abs_max"] == pytest.approx(LN(4))  # |log 0.25|
    # k3 of KL(gen || train) per token: r - 1 - log r, each >= 0
    assert m["mismatch/kl_gen_train"] == pytest.approx(sum(r - 1 - LN(r) for r in ratios) / 5)
    # icepop drops the 0.25 token: 1 of 5 tokens, 1 of 2 rows; kept weights 2, 0.6, 3, 1.5
    assert m["correction/masked_frac"] == pytest.approx(1 / 5) and m["correction/masked_seq_frac"] == 0.5
    assert m["correction/weight_mean"] == pytest.approx((2 + 0.6 + 3 + 1.5) / 4)
    assert m["correction/truncated_frac"] == 0.0


def test_metrics_reduce_over_micro_batches_as_over_the_whole_batch():
    objective = registry.get("algo", "grpo").build(None, max_completion_length=8)
    batch = _batch(MASK, GENERATOR, TRAINER)
    tis = registry.get("correction", "tis").build({"cap": 2.5})
    _, whole = corrected(tis, objective, batch, TRAINER)
    sums = MetricSums()
    for row in range(2):  # one row per micro-batch, as the engine's first pass corrects them with mu == 1
        part = batch.select(torch.tensor([row]))
        sums.add(corrected(tis, objective, part, TRAINER[row:row + 1, :part.completion_ids.shape[1]])[1])
    reduced, expected = mismatch_metrics(sums.result(passes=1)), mismatch_metrics(whole)
    assert reduced.keys() == expected.keys()
    for key, value in expected.items():
        assert reduced[key] == pytest.approx(value), key
    assert expected["mismatch/logp_abs_max"] == pytest.approx(LN(4))  # from row 1 only: a max, not a sum


def test_a_correction_that_drops_tokens_must_say_so():
    objective = registry.get("algo", "grpo").build(None, max_completion_length=8)
    with pytest.raises(ValueError, match="masks = False"):
        corrected(registry.get("correction", "icepop").build(None), objective, _batch(MASK, GENERATOR, TRAINER),
                  TRAINER, may_mask=False)
