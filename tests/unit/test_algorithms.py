"""The registered objectives: paper defaults, hand-derived advantages and losses, gradients against a naive loop."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from pydantic import ValidationError

from gpo import ops, registry
from gpo.algorithms.base import BaseObjective, ObjectiveConfig, PPOClip, StdScaledAdvantages
from gpo.errors import UserError
from gpo.types import StepTotals
from kit import LN2, REWARDS, assert_micro_batches_sum_to_the_step, build_objective, micro_batch

ALGOS = ("grpo", "dapo", "dr_grpo")


# --- registration and paper defaults ------------------------------------------------------------------------------


def test_every_objective_is_registered_and_has_the_full_interface():
    registry.load_builtins()
    assert set(ALGOS) <= set(registry.names("algo"))
    for name in ALGOS:
        objective = build_objective(name)
        for method in ("shape_rewards", "group_filter", "advantages", "loss_mask", "loss"):
            assert callable(getattr(objective, method)), (name, method)
        assert registry.get("algo", name).summary  # `gpo list` shows a line per objective


def test_paper_defaults():
    grpo, dapo, dr = (registry.get("algo", n).defaults() for n in ALGOS)
    assert (grpo["epsilon_low"], grpo["epsilon_high"], grpo["beta"], grpo["kl_estimator"]) == (0.2, 0.2, 0.04, "k3")
    assert (grpo["loss_agg"], grpo["std_eps"]) == ("seq_mean", 1e-4)
    assert (dapo["epsilon_low"], dapo["epsilon_high"], dapo["beta"]) == (0.2, 0.28, 0.0)
    assert dapo["dynamic_sampling"] and dapo["overlong_penalty"] and not dapo["mask_truncated"]
    assert (dr["epsilon_low"], dr["epsilon_high"], dr["beta"], dr["loss_normalizer"]) == (0.2, 0.2, 0.0, None)


def test_reference_logprobs_are_requested_only_when_needed():
    assert build_objective("grpo").needs_ref_logprobs  # beta 0.04
    assert not build_objective("grpo", beta=0.0).needs_ref_logprobs  # no reference model at all
    assert not build_objective("dapo").needs_ref_logprobs and not build_objective("dr_grpo").needs_ref_logprobs
    assert build_objective("dapo", beta=0.01).needs_ref_logprobs
    # Old log-probs are the engine's decision (train.mu > 1), not an objective's: no objective takes mu.
    for name in registry.names("algo"):
        assert not hasattr(build_objective(name), "needs_old_logprobs"), name
        with pytest.raises(TypeError, match="mu"):
            registry.get("algo", name).build(None, mu=2, max_completion_length=8)


@pytest.mark.parametrize(
    ("name", "cfg", "message"),
    [
        ("grpo", {"loss_agg": "token_sum"}, "loss_agg"),
        ("grpo", {"epsilon_low": 1.5}, "epsilon_low"),
        ("dapo", {"kl_estimator": "k5"}, "kl_estimator"),
        ("dr_grpo", {"dual_clip": 0.5}, "dual_clip"),
        ("dr_grpo", {"loss_normalizer": 0}, "loss_normalizer"),
        ("dapo", {"overlong_buffer": 0}, "overlong_buffer"),
    ],
)
def test_bad_settings_are_refused_by_the_config_type(name, cfg, message):
    with pytest.raises(ValidationError, match=message):
        build_objective(name, **cfg)


@pytest.mark.parametrize(
    ("name", "cfg", "context", "message"),
    [  # checks that involve the run's length limit, which the constructor gets from the engine
        ("dapo", {}, {"max_completion_length": None}, "max_completion_length"),
        ("dapo", {"overlong_buffer": 9}, {"max_completion_length": 8}, "overlong_buffer"),
        ("dr_grpo", {}, {"max_completion_length": None}, "loss_normalizer"),
    ],
)
def test_bad_settings_fail_in_the_constructor(name, cfg, context, message):
    with pytest.raises(UserError, match=message):
        build_objective(name, **context, **cfg)


# --- what the objectives share (algorithms/base.py) ---------------------------------------------------------------

# The parts of GRPO that each objective replaces (the table in algorithms/base.py); it keeps every other one.
REPLACED = {
    "grpo": set(),
    "dapo": {"shape_rewards", "group_filter", "loss_mask"},
    "dr_grpo": {"advantages"},
    "gspo": {"surrogate"},
    "cispo": {"surrogate"},
    "sapo": {"surrogate"},
    "gmpo": {"surrogate"},
    "rloo": {"surrogate", "advantages"},
    "reinforce_pp": {"advantages"},
}
AGGREGATE = {"grpo": ops.seq_mean, "dapo": ops.token_mean, "dr_grpo": ops.token_sum_norm, "gspo": ops.seq_mean,
             "cispo": ops.token_mean, "sapo": ops.seq_mean, "gmpo": ops.seq_mean, "rloo": ops.seq_mean,
             "reinforce_pp": ops.token_mean}
PARTS = ("shape_rewards", "group_filter", "advantages", "loss_mask", "surrogate", "loss")  # `aggregate`: AGGREGATE


def test_every_objective_derives_from_the_base_and_keeps_the_shared_parts():
    registry.load_builtins()
    assert set(registry.names("algo")) == set(REPLACED)  # a new objective gets a row here
    lengths, truncated = torch.tensor([[3, 8, 5, 8]] * 3), torch.tensor([[False, True, False, True]] * 3)
    batch = micro_batch([1.0, -1.0], [[1, 1], [1, 0]])
    for name, replaced in REPLACED.items():
        entry = registry.get("algo", name)
        assert issubclass(entry.config, ObjectiveConfig) and entry.config.__dataclass_params__.frozen, name
        assert issubclass(entry.cls, BaseObjective), name
        for part in PARTS:  # the objective's own definition only where it replaces the part
            assert (part in vars(entry.cls)) == (part in replaced), (name, part)
            if part not in replaced:
                assert getattr(entry.cls, part) is getattr(BaseObjective, part), (name, part)
        objective = build_objective(name)
        aggregate = getattr(objective.aggregate, "func", objective.aggregate)  # dr_grpo's is a partial
        assert aggregate is AGGREGATE[name], name
        assert (objective.policy_loss.surrogate is None) == ("surrogate" not in replaced), name  # PPO's clip
        if "shape_rewards" not in replaced:
            assert objective.shape_rewards(REWARDS, lengths, truncated) is REWARDS
        if "group_filter" not in replaced:
            assert objective.group_filter(REWARDS, {"accuracy": REWARDS}).tolist() == [True, True, True]
        if "loss_mask" not in replaced:
            assert objective.loss_mask(batch) is batch.completion_mask


def test_an_objective_that_replaces_no_part_trains_as_grpo():
    """What a new objective's file holds is only what differs from GRPO: with nothing replaced, it is GRPO."""

    @dataclasses.dataclass(frozen=True)
    class PlainConfig(ObjectiveConfig, PPOClip, StdScaledAdvantages):
        pass

    class Plain(BaseObjective):
        """GRPO's parts, nothing replaced."""

    plain, grpo = Plain(PlainConfig(), max_completion_length=8), build_objective("grpo")
    assert torch.equal(plain.advantages(REWARDS), grpo.advantages(REWARDS))
    gen = torch.Generator().manual_seed(11)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    old = -torch.rand(3, 3, generator=gen, dtype=torch.float64)
    logp = old + 0.4 * torch.randn(3, 3, generator=gen, dtype=torch.float64)
    batch = micro_batch([1.0, -0.5, 0.7], mask, old_logprobs=old, ref_logprobs=old.flip(1))
    (loss, metrics), (grpo_loss, grpo_metrics) = (o.loss(logp, batch, StepTotals(3, 6)) for o in (plain, grpo))
    assert loss.item() == grpo_loss.item() and metrics.keys() == grpo_metrics.keys()
    assert metrics["kl/mean"] > 0 and metrics["clip/high_frac"] + metrics["clip/low_frac"] > 0  # not vacuous


SHARED_BAD = [  # (field, a value its maths refuses); each objective's config that has the field refuses it
    ("beta", -0.1), ("kl_estimator", "k4"), ("kl_clamp", 0.0), ("std_eps", -1e-4), ("epsilon_high", -0.1),
    ("dual_clip", 1.0), ("loss_agg", "mean"),
]


@pytest.mark.parametrize("name", sorted(REPLACED))
def test_shared_settings_are_typed_alike_in_every_objective(name):
    entry = registry.get("algo", name)
    fields = {f.name for f in dataclasses.fields(entry.config)}
    assert {f.name for f in dataclasses.fields(ObjectiveConfig)} <= fields
    for field, value in SHARED_BAD:
        if field in fields:
            with pytest.raises(ValidationError, match=field):
                build_objective(name, **{field: value})
    good = build_objective(name, beta=0.1, kl_estimator="k2", kl_clamp=10.0)
    assert (good.cfg.beta, good.policy_loss.kl_estimator, good.policy_loss.kl_clamp) == (0.1, "k2", 10.0)
    assert good.needs_ref_logprobs
    if name not in ("gmpo", "sapo"):  # gmpo's bounds are in log space; sapo has no clip range
        with pytest.raises(ValidationError, match="epsilon_low"):
            build_objective(name, epsilon_low=1.0)  # a lower bound of 0 on the ratio
    assert "mu" not in fields  # the engine's loop count, not an objective's setting


# --- advantages, shaping, filtering -------------------------------------------------------------------------------

def test_advantages_by_hand():
    # group 0: mean .5, Bessel std sqrt(1/3) = .5773503; group 2: mean 1.5, deviations (1.5, -.5, -.5, -.5),
    # var (2.25 + 3 * .25) / 3 = 1, std 1
    grpo = build_objective("grpo").advantages(REWARDS)
    assert grpo[0, 0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-4))
    assert torch.equal(grpo[1], torch.zeros(4, dtype=torch.float64))
    assert grpo[2].tolist() == pytest.approx([1.5 / 1.0001, -0.5 / 1.0001, -0.5 / 1.0001, -0.5 / 1.0001])
    dapo = build_objective("dapo").advantages(REWARDS)  # eps 1e-6 (verl)
    assert dapo[2, 0].item() == pytest.approx(1.5 / (1 + 1e-6), abs=1e-12)
    dr = build_objective("dr_grpo").advantages(REWARDS)  # r - mean, no std
    assert dr.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [1.5, -0.5, -0.5, -0.5]]
    for name in ALGOS:
        with pytest.raises(UserError, match="G >= 2"):
            build_objective(name).advantages(torch.ones(3, 1))


def test_dynamic_sampling_drops_zero_variance_groups_in_dapo_only():
    acc = {"accuracy": REWARDS}
    assert build_objective("dapo").group_filter(REWARDS, acc).tolist() == [True, False, True]
    assert build_objective("dapo", dynamic_sampling=False).group_filter(REWARDS, acc).tolist() == [True, True, True]
    assert build_objective("grpo").group_filter(REWARDS, acc).tolist() == [True, True, True]
    assert build_objective("dr_grpo").group_filter(REWARDS, acc).tolist() == [True, True, True]


def test_dapo_filters_on_accuracy_not_on_the_shaped_total():
    # Group 0: all correct, but one completion ran into the overlong penalty, so the shaped total varies.
    # Group 1: all wrong with equal totals. Group 2: mixed accuracy. DAPO eq. 11 keeps only group 2.
    accuracy = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0]])
    total = torch.tensor([[1.0, 1.0, 0.7, 1.0], [0.1, 0.1, 0.1, 0.1], [1.1, 0.1, 0.1, 1.1]])
    components = {"accuracy": accuracy, "format": total - accuracy}
    assert build_objective("dapo").group_filter(total, components).tolist() == [False, False, True]
    assert build_objective("dapo", filter_on="total").group_filter(total, components).tolist() == [True, False, True]
    with pytest.raises(UserError, match="filter_on=total"):
        build_objective("dapo").group_filter(total, {"format": total})
    with pytest.raises(ValidationError, match="filter_on"):
        build_objective("dapo", filter_on="reward")


def test_dapo_soft_overlong_penalty():
    rewards = torch.ones(1, 4)
    lengths = torch.tensor([[7, 8, 9, 10]])
    truncated = torch.tensor([[False, False, False, True]])
    # Lmax 10, default buffer round(0.2 * 10) = 2: free up to 8, then -(len - 8) / 2: (0, 0, -0.5, -1)
    assert build_objective("dapo", max_completion_length=10).shape_rewards(rewards, lengths, truncated).tolist() == [
        [1.0, 1.0, 0.5, 0.0]
    ]
    # buffer 4, factor 0.5: free up to 6, then -(len - 6) / 4 * 0.5: (-0.125, -0.25, -0.375, -0.5)
    dapo = build_objective("dapo", max_completion_length=10, overlong_buffer=4, overlong_factor=0.5)
    assert dapo.shape_rewards(rewards, lengths, truncated).tolist() == [[0.875, 0.75, 0.625, 0.5]]
    assert build_objective("dapo", max_completion_length=48).buffer == 10  # round(9.6)
    no_penalty = build_objective("dapo", overlong_penalty=False)
    assert torch.equal(no_penalty.shape_rewards(rewards, lengths, truncated), rewards)
    assert torch.equal(build_objective("grpo").shape_rewards(rewards, lengths, truncated), rewards)


def test_dapo_can_mask_truncated_completions():
    batch = micro_batch([1.0, 1.0], [[1, 1], [1, 1]], truncated=[False, True])
    assert build_objective("dapo").loss_mask(batch).tolist() == [[1, 1], [1, 1]]  # paper default: keep them
    assert build_objective("dapo", mask_truncated=True).loss_mask(batch).tolist() == [[1, 1], [0, 0]]
    assert build_objective("grpo").loss_mask(batch).tolist() == [[1, 1], [1, 1]]


# --- losses by hand -----------------------------------------------------------------------------------------------

# Row 0: A = 1, two tokens; row 1: A = 0.5, one token and padding. mu = 1, so every ratio is 1 and the per-token
# policy loss is -A: (-1, -1) and (-0.5).
ADV, MASK = [1.0, 0.5], [[1, 1], [1, 0]]
TOTALS = StepTotals(sequences=2, tokens=3)


def test_grpo_loss_by_hand():
    logp = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[LN2, 0.0], [0.0, 0.0]], dtype=torch.float64)  # k3 = 2 - ln2 - 1 = .3068528 at one token
    batch = micro_batch(ADV, MASK, ref_logprobs=ref)
    k3 = 2 - LN2 - 1
    loss, m = build_objective("grpo").loss(logp, batch, TOTALS)
    # seq-mean: row means -1 and -0.5 -> -1.5 / 2 = -0.75; KL: .04 * (k3 / 2 + 0) / 2
    assert m["loss/policy"].item() == pytest.approx(-0.75)
    assert m["loss/kl"].item() == pytest.approx(0.04 * k3 / 4)
    assert loss.item() == pytest.approx(-0.75 + 0.04 * k3 / 4)
    assert m["kl/mean"].item() == pytest.approx(k3 / 3)
    # token-mean (CPPO code): (-1 - 1 - 0.5) / 3; KL .04 * k3 / 3
    loss, _ = build_objective("grpo", loss_agg="token_mean").loss(logp, batch, TOTALS)
    assert loss.item() == pytest.approx(-2.5 / 3 + 0.04 * k3 / 3)


def test_dapo_and_dr_grpo_losses_by_hand():
    logp = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    batch = micro_batch(ADV, MASK)
    loss, m = build_objective("dapo").loss(logp, batch, TOTALS)
    assert loss.item() == pytest.approx(-2.5 / 3)  # token mean
    assert "kl/mean" not in m and m["loss/kl"].item() == 0.0
    loss, _ = build_objective("dr_grpo", max_completion_length=4).loss(logp, batch, TOTALS)
    assert loss.item() == pytest.approx(-2.5 / (2 * 4))  # token sum / (sequences * Lmax) = -0.3125
    loss, _ = build_objective("dr_grpo", max_completion_length=4, loss_normalizer=10).loss(logp, batch, TOTALS)
    assert loss.item() == pytest.approx(-2.5 / (2 * 10))


def test_old_logprobs_are_used_when_given():
    # ratio exp(0 - ln(1/1.5)) = 1.5 on row 0's first token; DAPO clips at 1.28 there, GRPO at 1.2
    old = torch.tensor([[-math.log(1.5), 0.0], [0.0, 0.0]], dtype=torch.float64)
    batch = micro_batch(ADV, MASK, old_logprobs=old)
    logp = torch.zeros(2, 2, dtype=torch.float64)
    loss, m = build_objective("dapo").loss(logp, batch, TOTALS)
    assert loss.item() == pytest.approx((-1.28 - 1 - 0.5) / 3)
    assert m["clip/high_frac"].item() == pytest.approx(1 / 3) and m["ratio/token_max"].item() == pytest.approx(1.5)
    loss, _ = build_objective("grpo", beta=0.0).loss(logp, batch, TOTALS)
    assert loss.item() == pytest.approx((-(1.2 + 1) / 2 - 0.5) / 2)


# --- gradients against a naive per-row loop -----------------------------------------------------------------------


def naive_loss(logp, old, ref, adv, mask, *, eps_low, eps_high, beta, dual_clip, agg, sequences, tokens, norm=None):
    """The objective written token by token with Python scalars, independent of gpo/ops.py."""
    total = 0.0
    for i in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            if not mask[i][t]:
                continue
            a = float(adv[i])
            r = torch.exp(logp[i, t] - old[i, t])
            term = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
            if dual_clip is not None and a < 0:
                term = min(term, -a * dual_clip)
            x = ref[i, t] - logp[i, t]
            row.append(term + beta * (torch.exp(x) - x - 1))
        if agg == "seq_mean":
            total = total + (sum(row) / len(row) if row else 0.0)
        else:
            total = total + sum(row)
    if agg == "seq_mean":
        return total / sequences
    if agg == "token_mean":
        return total / tokens
    return total / (sequences * norm)


CASES = [
    ("grpo", {}, "seq_mean"),
    ("grpo", {"loss_agg": "token_mean", "dual_clip": 3.0, "kl_estimator": "k3"}, "token_mean"),
    ("dapo", {"beta": 0.02}, "token_mean"),
    ("dr_grpo", {"beta": 0.1}, "norm"),
]


@pytest.mark.parametrize(("name", "cfg", "agg"), CASES)
def test_gradient_matches_naive_loop(name, cfg, agg):
    gen = torch.Generator().manual_seed(sum(map(ord, name)) + len(cfg))
    n, length = 5, 6
    lengths = torch.tensor([6, 1, 3, 0, 4])  # a single-token row and a fully masked row
    mask = (torch.arange(length) < lengths.unsqueeze(1)).long()  # [n, L]
    old = -torch.rand(n, length, generator=gen, dtype=torch.float64) * 2  # [n, L]
    ref = old + 0.3 * torch.randn(n, length, generator=gen, dtype=torch.float64)
    start = old + 0.8 * torch.randn(n, length, generator=gen, dtype=torch.float64)  # ratios on both sides of clips
    adv = torch.randn(n, generator=gen, dtype=torch.float64)  # [n]
    totals = StepTotals(sequences=7, tokens=int(mask.sum()) + 5)  # this micro-batch is part of a bigger step
    objective = build_objective(name, max_completion_length=6, **cfg)
    spec = objective.policy_loss

    logp = start.clone().requires_grad_()
    loss, m = objective.loss(logp, micro_batch(adv, mask, old_logprobs=old, ref_logprobs=ref), totals)
    loss.backward()
    assert m["clip/low_frac"] > 0 and m["clip/high_frac"] > 0 and m.get("clip/dual_frac", 1) > 0  # every branch
    expected_logp = start.clone().requires_grad_()
    expected = naive_loss(expected_logp, old, ref, adv, mask.tolist(), eps_low=spec.eps_low, eps_high=spec.eps_high,
                          beta=spec.beta, dual_clip=spec.dual_clip, agg=agg, sequences=7, tokens=totals.tokens,
                          norm=6)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert torch.allclose(logp.grad, expected_logp.grad, atol=1e-12, rtol=0)
    assert logp.grad.abs().sum() > 0  # the check is not vacuous


@pytest.mark.parametrize("name", ALGOS)
def test_micro_batches_sum_to_the_step_loss_and_metrics(name):
    whole_m = assert_micro_batches_sum_to_the_step(build_objective(name, max_completion_length=5), seed=3)
    assert {k for k in whole_m if k.endswith(("_min", "_max"))} == {"ratio/token_min", "ratio/token_max"}


@pytest.mark.parametrize("name", ALGOS)
def test_single_token_and_fully_masked_rows(name):
    logp = torch.tensor([[-0.7], [-0.2]], dtype=torch.float64, requires_grad=True)  # L = 1
    batch = micro_batch([1.0, -1.0], [[1], [0]], ref_logprobs=torch.zeros(2, 1))
    loss, m = build_objective(name, beta=0.1).loss(logp, batch, StepTotals(2, 1))
    loss.backward()
    assert loss.isfinite() and all(v.isfinite() for v in m.values())
    assert logp.grad[1, 0].item() == 0.0 and logp.grad[0, 0].item() != 0.0
