"""gpo/ops.py on tiny inputs, with expected values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from gpo import ops
from gpo.errors import UserError
from gpo.metrics import advantage_metrics
from gpo.types import StepTotals
from kit import LN2, micro_batch

# --- advantages ---------------------------------------------------------------------------------------------------


def test_group_advantages_std_scaled_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)  # [1, 4]
    # mean 0.5 -> centred (0.5, -0.5, -0.5, 0.5); Bessel var = 4 * 0.25 / 3 = 1/3, std = 0.5773503
    std = math.sqrt(1 / 3)
    adv = ops.group_advantages(rewards, eps=0.0)
    assert torch.allclose(adv, torch.tensor([[1, -1, -1, 1]], dtype=torch.float64) * 0.5 / std)  # +-0.8660254
    # eps is added to the std, as in TRL: 0.5 / (0.5773503 + 1e-4) = 0.8658754
    adv = ops.group_advantages(rewards, eps=1e-4)
    assert adv[0, 0].item() == pytest.approx(0.5 / (std + 1e-4), abs=1e-12)
    assert adv[0, 0].item() == pytest.approx(0.8658754, abs=1e-7)


def test_group_advantages_without_std():
    rewards = torch.tensor([[3.0, 1.0], [0.0, 4.0]])  # means 2 and 2
    assert torch.equal(ops.group_advantages(rewards, scale_by_std=False), torch.tensor([[1.0, -1.0], [-2.0, 2.0]]))


@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-4])
def test_all_equal_rewards_give_exactly_zero(scale, eps):
    # 0.1 * 3 / 3 is 0.10000000000000002 in float64: the plain formula leaves a residue; it must be exactly 0.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [2.0, 2.0, 2.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    adv = ops.group_advantages(rewards, scale_by_std=scale, eps=eps)
    assert not adv.isnan().any()
    assert torch.equal(adv[:2], torch.zeros(2, 3, dtype=torch.float64))
    assert adv[2].abs().sum() > 0  # the mixed group keeps its signal


def test_group_of_one_is_a_clear_error():
    with pytest.raises(UserError, match=r"G >= 2"):
        ops.group_advantages(torch.ones(4, 1))
    with pytest.raises(UserError, match=r"\[B, G\]"):
        ops.group_advantages(torch.ones(4))
    with pytest.raises(UserError, match="epsilon"):
        ops.group_advantages(torch.ones(2, 2), eps=-1.0)


def test_overlong_penalty_by_hand():
    # Lmax 10, buffer 4: free up to 6 tokens, then -(len - 6) / 4 * factor
    lengths = torch.tensor([5, 6, 7, 10])
    # (5-6)/4 = -0.25 -> +0.25 -> clamp 0;  6 -> 0;  7 -> -0.25;  10 -> -1
    assert ops.overlong_penalty(lengths, 10, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -1.0]
    assert ops.overlong_penalty(lengths, 10, 4, 2.0).tolist() == [0.0, 0.0, -0.5, -2.0]
    with pytest.raises(UserError, match="overlong buffer"):
        ops.overlong_penalty(lengths, 10, 11, 1.0)


def test_advantage_metrics_by_hand():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    adv = torch.tensor([[1.0, -1.0], [0.0, 0.0]])
    m = advantage_metrics(rewards, adv)
    assert m["adv/mean"] == 0.0
    assert m["adv/std"] == pytest.approx(math.sqrt(2 / 3))  # (1 + 1 + 0 + 0) / 3
    assert m["adv/abs_mean"] == 0.5  # (1 + 1) / 4
    assert m["zero_std_frac"] == 0.5  # the second of two groups
    assert m["reward/mean"] == 0.75
    assert m["reward/std"] == pytest.approx(0.5)  # deviations .25 -.75 .25 .25: (3 * .0625 + .5625) / 3 = .25
    assert all(isinstance(v, float) for v in m.values())


# --- per-token terms ----------------------------------------------------------------------------------------------


def ratios_as_logp(*ratios):
    return torch.log(torch.tensor([ratios], dtype=torch.float64))  # [1, L], with old log-probs 0


def test_clipped_surrogate_positive_advantage():
    logp = ratios_as_logp(0.5, 1.0, 1.5)
    s = ops.clipped_surrogate(logp, torch.zeros_like(logp), torch.tensor([1.0]), eps_low=0.2, eps_high=0.2)
    # -A*r = (-0.5, -1, -1.5); -A*clip(r, .8, 1.2) = (-0.8, -1, -1.2); max = (-0.5, -1, -1.2)
    assert torch.allclose(s.loss, torch.tensor([[-0.5, -1.0, -1.2]], dtype=torch.float64))
    assert s.high_clipped.tolist() == [[False, False, True]]
    assert not s.low_clipped.any()
    assert torch.allclose(s.ratio, torch.tensor([[0.5, 1.0, 1.5]], dtype=torch.float64))
    # clip-higher 0.28: r = 1.5 clips to 1.28 -> -1.28
    s = ops.clipped_surrogate(logp, torch.zeros_like(logp), torch.tensor([1.0]), eps_low=0.2, eps_high=0.28)
    assert s.loss[0, 2].item() == pytest.approx(-1.28)


def test_clipped_surrogate_negative_advantage_and_dual_clip():
    logp = ratios_as_logp(0.5, 1.0, 1.5, 4.0)
    adv = torch.tensor([-1.0])
    s = ops.clipped_surrogate(logp, torch.zeros_like(logp), adv, eps_low=0.2, eps_high=0.2)
    # -A*r = (0.5, 1, 1.5, 4); -A*clip = (0.8, 1, 1.2, 1.2); max = (0.8, 1, 1.5, 4)
    assert torch.allclose(s.loss, torch.tensor([[0.8, 1.0, 1.5, 4.0]], dtype=torch.float64))
    assert s.low_clipped.tolist() == [[True, False, False, False]]
    assert not s.high_clipped.any() and not s.dual_clipped.any()
    # dual clip c = 3: the cap -A*c = 3 applies only to r = 4
    s = ops.clipped_surrogate(logp, torch.zeros_like(logp), adv, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    assert torch.allclose(s.loss, torch.tensor([[0.8, 1.0, 1.5, 3.0]], dtype=torch.float64))
    assert s.dual_clipped.tolist() == [[False, False, False, True]]
    # the cap never touches positive advantages: -A*r = -4 -> clip -> max(-4, -1.2) = -1.2
    s = ops.clipped_surrogate(logp, torch.zeros_like(logp), torch.tensor([1.0]), eps_low=0.2, eps_high=0.2,
                              dual_clip=3.0)
    assert s.loss[0, 3].item() == pytest.approx(-1.2) and not s.dual_clipped.any()


def test_kl_estimators_by_hand():
    logp = torch.zeros(1, 1, dtype=torch.float64)
    ref = torch.full((1, 1), LN2, dtype=torch.float64)  # pi_ref / pi = 2, x = ln 2 = 0.6931472
    assert ops.kl_penalty(logp, ref, "k1").item() == pytest.approx(-LN2)
    assert ops.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * LN2**2)  # 0.2402265
    assert ops.kl_penalty(logp, ref, "k3").item() == pytest.approx(2 - LN2 - 1)  # 0.3068528
    # x = 5: k3 = e^5 - 5 - 1 = 142.41; clamped to 10 as verl's low_var_kl
    ref = torch.full((1, 1), 5.0, dtype=torch.float64)
    assert ops.kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(5) - 6)
    assert ops.kl_penalty(logp, ref, "k3", clamp=10.0).item() == 10.0
    assert ops.kl_penalty(logp, logp, "k3").item() == 0.0  # identical policies
    with pytest.raises(UserError, match="k1, k2, k3"):
        ops.kl_penalty(logp, ref, "k4")


# --- aggregation --------------------------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])  # 99 sits on padding and must not count
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_aggregations_by_hand():
    totals = StepTotals(sequences=4, tokens=8)  # this micro-batch is part of a larger step
    # seq-mean: row means (1+2+3)/3 = 2 and 4 -> (2 + 4) / 4 sequences = 1.5
    assert ops.seq_mean(LOSS, MASK, totals).item() == 1.5
    # token-mean: (1+2+3+4) / 8 tokens = 1.25
    assert ops.token_mean(LOSS, MASK, totals).item() == 1.25
    # constant normaliser 5: 10 / (4 sequences * 5) = 0.5
    assert ops.token_sum_norm(LOSS, MASK, totals, normaliser=5).item() == 0.5


@pytest.mark.parametrize("aggregate",
                         [ops.seq_mean, ops.token_mean, lambda loss, m, t: ops.token_sum_norm(loss, m, t, 7)])
def test_micro_batch_shares_add_up_to_the_step(aggregate):
    torch.manual_seed(0)
    loss = torch.randn(6, 5, dtype=torch.float64)  # [N, L]
    mask = (torch.arange(5) < torch.tensor([5, 1, 3, 2, 4, 5]).unsqueeze(1)).long()  # [N, L] ragged lengths
    totals = StepTotals(sequences=6, tokens=int(mask.sum()))
    whole = aggregate(loss, mask, totals)
    parts = sum(aggregate(loss[rows], mask[rows], totals) for rows in (slice(0, 1), slice(1, 4), slice(4, 6)))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-12)


def test_fully_masked_rows_contribute_zero_without_nan():
    loss = torch.tensor([[float("nan"), float("inf")], [2.0, 4.0]])
    mask = torch.tensor([[0, 0], [1, 1]])
    totals = StepTotals(sequences=2, tokens=2)
    assert ops.seq_mean(loss, mask, totals).item() == 1.5  # (0 + 3) / 2
    assert ops.token_mean(loss, mask, totals).item() == 3.0  # 6 / 2
    assert ops.token_sum_norm(loss, mask, totals, 3).item() == 1.0  # 6 / (2 * 3)
    empty = StepTotals(sequences=0, tokens=0)  # a step with nothing to train must not divide by zero
    assert ops.token_mean(loss, torch.zeros_like(mask), empty).item() == 0.0


# --- the combined loss --------------------------------------------------------------------------------------------


def test_policy_loss_by_hand_with_kl_and_metrics():
    # Two rows: A = 1 with 2 tokens, A = -1 with 1 token (+1 padding). old = 0, so ratio = exp(logp).
    logp = torch.log(torch.tensor([[1.5, 1.0], [0.5, 1.0]], dtype=torch.float64)).requires_grad_()
    ref = torch.tensor([[0.0, LN2], [0.0, 0.0]], dtype=torch.float64)
    batch = micro_batch([1.0, -1.0], [[1, 1], [1, 0]], old_logprobs=torch.zeros(2, 2), ref_logprobs=ref)
    totals = StepTotals(sequences=2, tokens=3)
    spec = ops.PolicyLoss(eps_low=0.2, eps_high=0.2, beta=0.1)
    loss, m = spec(logp, batch, batch.completion_mask, totals, ops.token_mean)
    # surrogate: row 0 r = (1.5, 1): (-1.2, -1); row 1 r = 0.5, A = -1: max(0.5, 0.8) = 0.8  -> sum -1.4
    # k3: row 0 token 0: x = 0 - ln 1.5 -> 1/1.5 + ln 1.5 - 1 = 0.0721318; token 1: x = ln 2 -> 0.3068528
    #     row 1 token 0: x = -ln 0.5 = ln 2 -> 2 - ln 2 - 1 = 0.3068528
    k = [1 / 1.5 + math.log(1.5) - 1, 2 - LN2 - 1, 2 - LN2 - 1]
    assert m["loss/policy"].item() == pytest.approx(-1.4 / 3)
    assert m["kl/mean"].item() == pytest.approx(sum(k) / 3)
    assert m["loss/kl"].item() == pytest.approx(0.1 * sum(k) / 3)
    assert loss.item() == pytest.approx((-1.4 + 0.1 * sum(k)) / 3)
    assert m["clip/high_frac"].item() == pytest.approx(1 / 3)  # r = 1.5 with A > 0
    assert m["clip/low_frac"].item() == pytest.approx(1 / 3)  # r = 0.5 with A < 0
    assert m["ratio/mean"].item() == pytest.approx((1.5 + 1.0 + 0.5) / 3)
    assert (m["ratio/token_min"].item(), m["ratio/token_max"].item()) == pytest.approx((0.5, 1.5))
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())
    assert "clip/dual_frac" not in m


def test_policy_loss_mu_one_uses_detached_current_logprobs():
    logp = torch.tensor([[-1.3, -0.2, -7.0]], dtype=torch.float64, requires_grad=True)
    batch = micro_batch([2.0], [[1, 1, 1]])  # old_logprobs None: mu == 1
    loss, m = ops.PolicyLoss(eps_low=0.2, eps_high=0.2)(logp, batch, batch.completion_mask,
                                                        StepTotals(1, 3), ops.token_mean)
    assert m["ratio/token_min"].item() == 1.0 and m["ratio/token_max"].item() == 1.0  # exactly 1, no clipping
    # loss = -A * r = -2 per token, mean -2; d/dlogp of -A*exp(logp - sg(logp)) / 3 = -2/3 per token
    assert loss.item() == -2.0
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 3), -2 / 3, dtype=torch.float64))


def test_policy_loss_ignores_garbage_padding_and_empty_rows():
    logp = torch.tensor([[-0.5, -math.inf], [-math.inf, -math.inf]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.4, math.nan], [math.nan, math.nan]], dtype=torch.float64)
    batch = micro_batch([1.0, -1.0], [[1, 0], [0, 0]], old_logprobs=old, ref_logprobs=old)
    spec = ops.PolicyLoss(eps_low=0.2, eps_high=0.28, beta=0.04, dual_clip=3.0)
    for aggregate in (ops.seq_mean, ops.token_mean):
        loss, m = spec(logp, batch, batch.completion_mask, StepTotals(2, 1), aggregate)
        loss.backward()
        assert loss.isfinite() and all(v.isfinite() for v in m.values())
        assert logp.grad.isfinite().all() and (logp.grad[batch.completion_mask == 0] == 0).all()
        logp.grad = None
    _, m = spec(logp, batch, torch.zeros(2, 2), StepTotals(2, 0), ops.token_mean)
    # no token counts: the identities of min and max, so the engine's reduction ignores this micro-batch
    assert m["ratio/token_min"].item() == math.inf and m["ratio/token_max"].item() == -math.inf


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.epsilon_low=1.0", "`algo.epsilon_low` must be < 1"),
        ("algo.epsilon_high=-0.1", "`algo.epsilon_high` must be >= 0"),
        ("algo.beta=-1.0", "`algo.beta` must be >= 0"),
        ("algo.kl_estimator=k9", "`algo.kl_estimator` must be one of k1, k2, k3"),
        ("algo.kl_clamp=0.0", "`algo.kl_clamp` must be > 0"),
        ("algo.dual_clip=1.0", "`algo.dual_clip` must be > 1"),
    ],
)
def test_policy_loss_settings_are_validated_where_they_are_set(override, message):
    """The loss's settings come from the objective's config, whose annotations hold their ranges."""
    from gpo.config import compose

    with pytest.raises(UserError, match=message):
        compose(["algo=grpo", override])


def test_dual_clip_with_an_objectives_own_surrogate_is_refused():
    with pytest.raises(UserError, match="dual_clip applies to the clipped ratio only"):
        ops.PolicyLoss(dual_clip=3.0, surrogate=lambda *args: None)  # type: ignore[arg-type,return-value]


def test_policy_loss_needs_ref_logprobs_when_beta_positive():
    batch = micro_batch([1.0], [[1]])
    spec = ops.PolicyLoss(eps_low=0.2, eps_high=0.2, beta=0.1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        spec(torch.zeros(1, 1), batch, batch.completion_mask, StepTotals(1, 1), ops.token_mean)
