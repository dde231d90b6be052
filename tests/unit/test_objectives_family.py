"""The six objectives beyond GRPO/DAPO/Dr.GRPO (gspo, cispo, sapo, gmpo, rloo, reinforce_pp): paper defaults, bad
settings, hand-derived advantages and losses, and equivalence to verl's published formulas over micro-batches and
two ranks. TRL's own code is compared in tests/unit/test_trl_equivalence.py.

The verl references below are written here from the formulas of verl's `core_algos.py` (policy losses `gspo`,
`cispo`, `sapo`, `geo_mean`; advantage estimators `rloo`, `reinforce_plus_plus_baseline`; `agg_loss` with the
global batch counts and `masked_whiten`), independently of gpo/ops.py.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from pydantic import ValidationError

from gpo import registry
from gpo.errors import UserError
from gpo.types import StepTotals
from kit import LN2, REWARDS, assert_micro_batches_sum_to_the_step, build_objective, micro_batch

NEW = ("gspo", "cispo", "sapo", "gmpo", "rloo", "reinforce_pp")
TOL = 1e-6


def loss_and_grad(objective, logp, batch, totals):
    logp = logp.detach().clone().requires_grad_()
    loss, metrics = objective.loss(logp, batch, totals)
    loss.backward()
    return loss.detach(), logp.grad, metrics


# --- registration, defaults, settings -----------------------------------------------------------------------------


def test_registered_with_a_paper_in_the_summary_and_the_full_interface():
    registry.load_builtins()
    for name in NEW:
        entry = registry.get("algo", name)
        assert "arXiv" in entry.summary, name  # `gpo list algo` names the paper
        objective = build_objective(name)
        for method in ("shape_rewards", "group_filter", "advantages", "loss_mask", "loss"):
            assert callable(getattr(objective, method)), (name, method)
        assert not objective.needs_ref_logprobs and build_objective(name, beta=0.01).needs_ref_logprobs


def test_gpo_list_algo_shows_each_ones_paper_and_defaults(capsys):
    from gpo import cli

    assert cli.main(["list", "algo"]) == 0
    out = capsys.readouterr().out
    papers = {"gspo": "2507.18071", "cispo": "2506.13585", "sapo": "2511.20347", "gmpo": "2507.20673",
              "rloo": "2402.14740", "reinforce_pp": "2501.03262"}
    parts = re.split(r"^  (\w+) +", out, flags=re.M)  # [head, name1, block1, name2, block2, ...]
    blocks = dict(zip(parts[1::2], parts[2::2], strict=True))
    for name, arxiv in papers.items():
        assert arxiv in blocks[name], (name, blocks.get(name))
        for key, value in registry.get("algo", name).defaults().items():
            assert f"      {key} = {value!r}" in blocks[name], (name, key)


def test_paper_defaults():
    d = {name: registry.get("algo", name).defaults() for name in NEW}
    assert (d["gspo"]["epsilon_low"], d["gspo"]["epsilon_high"]) == (3e-4, 4e-4)
    assert (d["cispo"]["epsilon_low"], d["cispo"]["epsilon_high"]) == (None, 4.0)  # cap 5, no lower bound
    assert build_objective("cispo").weight_max == 5.0 and build_objective("cispo").weight_min is None
    assert (d["sapo"]["tau_pos"], d["sapo"]["tau_neg"]) == (1.0, 1.05)
    assert (d["gmpo"]["epsilon_low"], d["gmpo"]["epsilon_high"]) == (0.4, 0.4)
    assert (d["rloo"]["epsilon_low"], d["rloo"]["epsilon_high"]) == (0.2, 0.2)
    assert (d["reinforce_pp"]["kl_estimator"], d["reinforce_pp"]["whiten_eps"]) == ("k2", 1e-8)
    assert all(d[name]["beta"] == 0.0 for name in NEW)


@pytest.mark.parametrize(("name", "cfg", "message"), [
    ("gspo", {"epsilon_low": 1.0}, "epsilon_low"),
    ("gmpo", {"epsilon_high": -0.1}, "epsilon_high"),
    ("rloo", {"epsilon_low": -0.1}, "epsilon_low"),
    ("cispo", {"epsilon_low": 1.5}, "epsilon_low"),
    ("cispo", {"epsilon_high": -1.0}, "epsilon_high"),
    ("sapo", {"tau_neg": 0.0}, "tau_neg"),
    ("reinforce_pp", {"whiten_eps": 0.0}, "whiten_eps"),
    ("reinforce_pp", {"dual_clip": 0.5}, "dual_clip"),
    ("sapo", {"kl_estimator": "k7"}, "kl_estimator"),
])
def test_bad_settings_are_refused_by_the_config_type(name, cfg, message):
    with pytest.raises(ValidationError, match=message):
        build_objective(name, **cfg)


# --- advantages ---------------------------------------------------------------------------------------------------


def test_leave_one_out_advantages_by_hand():
    # group 0 (1, 0, 0, 1): a 1 is compared with the others' mean 1/3, a 0 with 2/3; group 2 (3, 1, 1, 1): the 3 with
    # 1, each 1 with (3 + 1 + 1) / 3 = 5/3
    adv = build_objective("rloo").advantages(REWARDS)
    assert adv[0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-12)
    assert torch.equal(adv[1], torch.zeros(4, dtype=torch.float64))
    assert adv[2].tolist() == pytest.approx([2.0, -2 / 3, -2 / 3, -2 / 3], abs=1e-12)
    with pytest.raises(UserError, match="G >= 2"):
        build_objective("rloo").advantages(torch.ones(3, 1))


def test_reinforce_pp_whitens_over_the_whole_batch_by_hand():
    # r - group mean: (.5, -.5, -.5, .5), (0, 0, 0, 0), (1.5, -.5, -.5, -.5). Over the 12 values: mean 0,
    # Bessel variance (4 * .25 + 2.25 + 3 * .25) / 11 = 4/11, so every value is multiplied by sqrt(11/4) = 1.6583124
    adv = build_objective("reinforce_pp").advantages(REWARDS)
    scale = 1 / math.sqrt(4 / 11 + 1e-8)
    assert adv[0].tolist() == pytest.approx([0.5 * scale, -0.5 * scale, -0.5 * scale, 0.5 * scale], abs=1e-12)
    assert torch.equal(adv[1], torch.zeros(4, dtype=torch.float64))  # no signal stays exactly 0
    assert adv[2, 0].item() == pytest.approx(1.5 * 1.6583124, abs=1e-7)
    # One batch-wide scale, unlike GRPO's per-group std: the rows of group 0 and group 2 share it.
    grpo = build_objective("grpo").advantages(REWARDS)
    assert adv[0, 0] / adv[2, 1] == pytest.approx(-1.0) and grpo[0, 0] / grpo[2, 1] != pytest.approx(-1.0)
    # All groups flat: no NaN, all 0.
    assert torch.equal(build_objective("reinforce_pp").advantages(torch.ones(2, 4)), torch.zeros(2, 4))


def verl_rloo(scores, index):
    """verl `rloo`: r * n / (n - 1) - mean * n / (n - 1) within each prompt index."""
    out = scores.clone()
    for i in range(len(scores)):
        group = scores[index == index[i]]
        n = len(group)
        out[i] = scores[i] * n / (n - 1) - group.mean() * n / (n - 1)
    return out


def verl_reinforce_pp_baseline(scores, index, mask):
    """verl `reinforce_plus_plus_baseline`: r - group mean on every token, then `masked_whiten` over all tokens."""
    centred = torch.stack([scores[i] - scores[index == index[i]].mean() for i in range(len(scores))])  # [N]
    values = centred.unsqueeze(1) * mask  # [N, L]
    count = mask.sum()
    mean = (values * mask).sum() / count
    var = ((values - mean) ** 2 * mask).sum() / count * (count / (count - 1))  # unbiased, as masked_var
    return (values - mean) * torch.rsqrt(var + 1e-8) * mask


def test_advantages_match_verl():
    gen = torch.Generator().manual_seed(11)
    rewards = torch.rand(5, 4, generator=gen, dtype=torch.float64)  # [B, G]
    rewards[:2] = rewards[:2].round()
    rewards[0] = 1.0
    index = torch.arange(5).repeat_interleave(4)  # [N]
    assert torch.allclose(build_objective("rloo").advantages(rewards).flatten(), verl_rloo(rewards.flatten(), index),
                          atol=TOL, rtol=0)
    # One token per sequence: verl's token-weighted whitening is gpo's sequence-weighted one.
    ours = build_objective("reinforce_pp").advantages(rewards).flatten()  # [N]
    same = verl_reinforce_pp_baseline(rewards.flatten(), index, torch.ones(20, 1, dtype=torch.float64))
    assert torch.allclose(ours.unsqueeze(1), same, atol=TOL, rtol=0)
    # Unequal lengths: verl weights each sequence by its length; gpo does not (a documented difference).
    lengths = torch.randint(1, 9, (20,), generator=gen)
    lengths[0], lengths[1] = 1, 8
    mask = (torch.arange(8) < lengths.unsqueeze(1)).to(torch.float64)  # [N, L]
    weighted = verl_reinforce_pp_baseline(rewards.flatten(), index, mask)
    assert not torch.allclose((ours.unsqueeze(1) * mask), weighted, atol=1e-3, rtol=0)


# --- losses by hand -----------------------------------------------------------------------------------------------


def one_row(logp, old, adv):
    """A micro-batch of one row whose tokens all count; returns (logp [1, L], batch, totals)."""
    logp = torch.tensor([logp], dtype=torch.float64)
    batch = micro_batch([adv], torch.ones_like(logp, dtype=torch.long), old_logprobs=[old])
    return logp, batch, StepTotals(sequences=1, tokens=logp.shape[1])


def test_gspo_by_hand():
    # log ratios (.1, .3): s = exp(.2) = 1.2214028, one term per sequence; with clip .2/.28 it is inside the range,
    # so loss -A*s and each token's gradient -A * s / 2 (d s / d logp_t = s / |y|)
    logp, batch, totals = one_row([0.1, 0.3], [0.0, 0.0], 1.0)
    loss, grad, m = loss_and_grad(build_objective("gspo", epsilon_low=0.2, epsilon_high=0.28), logp, batch, totals)
    assert loss.item() == pytest.approx(-1.2214028, abs=1e-7)
    assert grad.tolist()[0] == pytest.approx([-0.6107014, -0.6107014], abs=1e-7)
    assert m["ratio/token_max"].item() == pytest.approx(1.2214028, abs=1e-7)  # the sequence's ratio on its tokens
    # Paper clip 3e-4 / 4e-4: s > 1.0004 with A > 0 is clipped: loss -1.0004, no gradient, both tokens flagged.
    loss, grad, m = loss_and_grad(build_objective("gspo"), logp, batch, totals)
    assert loss.item() == pytest.approx(-1.0004, abs=1e-12) and torch.equal(grad, torch.zeros_like(grad))
    assert m["clip/high_frac"].item() == 1.0


def test_cispo_by_hand():
    # ratios 2 and 8; cap 5 -> weights 2 and 5 (detached); A = 1; token mean over 2 tokens:
    # loss -(2 ln 2 + 5 ln 8) / 2 = -5.8917511, gradient -(2, 5) / 2: the capped token keeps a gradient
    logp, batch, totals = one_row([LN2, 3 * LN2], [0.0, 0.0], 1.0)
    loss, grad, m = loss_and_grad(build_objective("cispo"), logp, batch, totals)
    assert loss.item() == pytest.approx(-(2 * LN2 + 5 * 3 * LN2) / 2, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([-1.0, -2.5], abs=1e-12)
    assert m["clip/high_frac"].item() == 0.5 and m["clip/low_frac"].item() == 0.0
    # verl's two-sided clip [0.8, 1.2]: weights 1.2 and 1.2; a ratio of 0.5 is raised to 0.8
    logp, batch, totals = one_row([LN2, -LN2], [0.0, 0.0], -1.0)
    loss, grad, m = loss_and_grad(build_objective("cispo", epsilon_low=0.2, epsilon_high=0.2), logp, batch, totals)
    assert loss.item() == pytest.approx((1.2 * LN2 + 0.8 * -LN2) / 2, abs=1e-12)
    assert grad.tolist()[0] == pytest.approx([0.6, 0.4], abs=1e-12)
    assert m["clip/high_frac"].item() == 0.5 and m["clip/low_frac"].item() == 0.5


def test_sapo_by_hand():
    # on-policy (r = 1): gate 4/tau * sigmoid(0) = 2/tau, gradient 4 * sigmoid'(0) * r = 1 per unit of -A, GRPO's
    logp, batch, totals = one_row([-0.5], [-0.5], 1.0)
    loss, grad, _ = loss_and_grad(build_objective("sapo"), logp, batch, totals)
    assert loss.item() == pytest.approx(-2.0, abs=1e-12) and grad.item() == pytest.approx(-1.0, abs=1e-12)
    logp, batch, totals = one_row([-0.5], [-0.5], -1.0)  # A < 0: tau_neg 1.05
    loss, grad, _ = loss_and_grad(build_objective("sapo"), logp, batch, totals)
    assert loss.item() == pytest.approx(2 / 1.05, abs=1e-12) and grad.item() == pytest.approx(1.0, abs=1e-12)
    # r = 2, A = 1, tau 1: loss -4 sigmoid(1) = -2.9242344; gradient -4 sigmoid(1) (1 - sigmoid(1)) * 2 = -1.5728954
    logp, batch, totals = one_row([LN2], [0.0], 1.0)
    loss, grad, m = loss_and_grad(build_objective("sapo"), logp, batch, totals)
    assert loss.item() == pytest.approx(-2.9242344, abs=1e-7) and grad.item() == pytest.approx(-1.5728954, abs=1e-7)
    assert m["clip/high_frac"].item() == 0.0  # nothing is clipped, only damped


def test_gmpo_by_hand():
    # A = 1, log ratios (.1, .6): .6 is clipped to .4 (upper bound only), mean .25, R = exp(.25) = 1.2840254;
    # loss -R; gradient -R / 2 on the first token, 0 on the clipped one
    logp, batch, totals = one_row([0.1, 0.6], [0.0, 0.0], 1.0)
    loss, grad, m = loss_and_grad(build_objective("gmpo"), logp, batch, totals)
    assert loss.item() == pytest.approx(-1.2840254, abs=1e-7)
    assert grad.tolist()[0] == pytest.approx([-0.6420127, 0.0], abs=1e-7)
    assert m["clip/high_frac"].item() == 0.5
    # A = -1, log ratios (-.6, .1): -.6 is raised to -.4 (lower bound only), mean -.15, R = exp(-.15) = .8607080
    logp, batch, totals = one_row([-0.6, 0.1], [0.0, 0.0], -1.0)
    loss, grad, m = loss_and_grad(build_objective("gmpo"), logp, batch, totals)
    assert loss.item() == pytest.approx(0.8607080, abs=1e-7)
    assert grad.tolist()[0] == pytest.approx([0.0, 0.4303540], abs=1e-7)
    assert m["clip/low_frac"].item() == 0.5


def test_rloo_by_hand():
    # log ratios (.1, .05): the completion's ratio is their product exp(.15) = 1.1618342, inside [.8, 1.2]:
    # loss -A * 1.1618342 and every token's gradient -A * 1.1618342 (a token sum, no division by the length)
    logp, batch, totals = one_row([0.1, 0.05], [0.0, 0.0], 1.0)
    loss, grad, _ = loss_and_grad(build_objective("rloo"), logp, batch, totals)
    assert loss.item() == pytest.approx(-1.1618342, abs=1e-7)
    assert grad.tolist()[0] == pytest.approx([-1.1618342, -1.1618342], abs=1e-7)
    # exp(.3) = 1.35 > 1.2 with A > 0: clipped, no gradient
    logp, batch, totals = one_row([0.1, 0.2], [0.0, 0.0], 1.0)
    loss, grad, _ = loss_and_grad(build_objective("rloo"), logp, batch, totals)
    assert loss.item() == pytest.approx(-1.2, abs=1e-12) and torch.equal(grad, torch.zeros_like(grad))


# --- verl's formulas, over micro-batches and two ranks -------------------------------------------------------------


def verl_aggregate(loss, mask, mode, dp_size, tokens, sequences):
    """verl `agg_loss` with the global batch counts; multiplied by dp_size, which FSDP's mean over ranks undoes."""
    if mode == "token-mean":
        return (loss * mask).sum() / tokens * dp_size
    per_seq = (loss * mask).sum(-1) / (mask.sum(-1) + 1e-8)  # seq-mean-token-mean
    return (per_seq * (mask.sum(-1) > 0)).sum() / sequences * dp_size


def verl_gspo(logp, old, adv, mask, eps_low, eps_high, **agg):
    """Token-level form: log s_i,t = sg(mean_t log r) + logp - sg(logp), clamped at 10; PPO clip; seq-mean."""
    seq = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = (logp - logp.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_s)
    a = adv.unsqueeze(-1)
    loss = torch.maximum(-a * s, -a * s.clamp(1 - eps_low, 1 + eps_high))
    return verl_aggregate(loss, mask, "seq-mean-token-mean", **agg)


def verl_cispo(logp, old, adv, mask, eps_low, eps_high, **agg):
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
    return verl_aggregate(-weight * adv.unsqueeze(-1) * logp, mask, "token-mean", **agg)


def verl_sapo(logp, old, adv, mask, tau_pos, tau_neg, **agg):
    ratio = torch.exp((logp - old).clamp(-20.0, 20.0))
    a = adv.unsqueeze(-1)
    tau = torch.where(a > 0, torch.tensor(tau_pos, dtype=a.dtype), torch.tensor(tau_neg, dtype=a.dtype))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return verl_aggregate(-gate * a, mask, "seq-mean-token-mean", **agg)


def verl_geo_mean(logp, old, adv, mask, eps_low, eps_high, micro_batches, **agg):
    """verl `geo_mean`: sign-aware clamp of log r, exp of its token mean, -A * that, mean over the micro-batch's
    rows (it ignores the global counts); the accumulation over equal micro-batches divides by their number."""
    log_r = logp - old
    a = adv.unsqueeze(-1) * torch.ones_like(log_r)
    sign = torch.sign(a)
    clamped = torch.clamp(log_r, -eps_low, eps_high)
    bounded = sign * torch.minimum(sign * log_r, sign * clamped)
    count = mask.sum(-1)
    ratio = torch.exp((bounded * mask).sum(-1) / (count + 1e-8))
    advantage = (a * mask).sum(-1) / (count + 1e-8)
    return (-advantage * ratio).mean() / micro_batches


VERL = {  # gpo objective and settings -> verl reference with the same settings
    "gspo": ({}, lambda **k: verl_gspo(eps_low=3e-4, eps_high=4e-4, **k)),
    "gspo-wide": ({"epsilon_low": 0.2, "epsilon_high": 0.28}, lambda **k: verl_gspo(eps_low=0.2, eps_high=0.28, **k)),
    "cispo": ({"epsilon_low": 0.2, "epsilon_high": 0.28}, lambda **k: verl_cispo(eps_low=0.2, eps_high=0.28, **k)),
    "sapo": ({}, lambda **k: verl_sapo(tau_pos=1.0, tau_neg=1.05, **k)),
    "gmpo": ({}, lambda micro_batches, **k: verl_geo_mean(eps_low=0.4, eps_high=0.4, micro_batches=micro_batches,
                                                          **k)),
}
SCALES = {"gspo": 5e-4, "gspo-wide": 0.3, "cispo": 0.5, "sapo": 0.8, "gmpo": 0.5}


def rollout(seed, scale, n=8, length=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (n,), generator=gen)
    lengths[1] = 1
    mask = (torch.arange(length) < lengths.unsqueeze(1)).to(torch.float64)  # [n, L]
    old = -2 * torch.rand(n, length, generator=gen, dtype=torch.float64)
    logp = old + scale * torch.randn(n, length, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    return logp, old, adv, mask


@pytest.mark.parametrize("case", list(VERL))
@pytest.mark.parametrize(("ranks", "micro_batches"), [(1, 1), (1, 2), (2, 2)])
def test_losses_and_gradients_match_verl(case, ranks, micro_batches):
    """The step's rows split over ranks, each rank's over equal micro-batches. verl's gradient is the mean over ranks
    of each rank's summed micro-batch gradients; gpo's is the sum of all shares (the engine undoes DDP's mean)."""
    cfg, verl = VERL[case]
    logp, old, adv, mask = rollout(seed=sum(map(ord, case)) + 7 * ranks + micro_batches, scale=SCALES[case])
    n = len(adv)
    objective = build_objective(case.split("-")[0], **cfg)
    totals = StepTotals(sequences=n, tokens=int(mask.sum()))
    agg = {"dp_size": ranks, "tokens": totals.tokens, "sequences": n}
    if case == "gmpo":
        agg = {"micro_batches": micro_batches}
    ours_grad, verl_grad = torch.zeros_like(logp), torch.zeros_like(logp)
    ours_loss = verl_loss = 0.0
    parts = ranks * micro_batches
    for rows in torch.arange(n).chunk(parts):
        batch = micro_batch(adv[rows], mask[rows].long(), old_logprobs=old[rows])
        loss, grad, _ = loss_and_grad(objective, logp[rows], batch, totals)
        ours_loss, ours_grad[rows] = ours_loss + loss, grad
        x = logp[rows].clone().requires_grad_()
        theirs = verl(logp=x, old=old[rows], adv=adv[rows], mask=mask[rows], **agg)
        theirs.backward()
        verl_loss, verl_grad[rows] = verl_loss + theirs.detach() / ranks, x.grad / ranks
    assert abs(float(ours_loss - verl_loss)) < TOL, (ours_loss, verl_loss)
    assert torch.allclose(ours_grad * mask, verl_grad * mask, atol=TOL, rtol=0)
    assert (ours_grad.abs().sum(-1) > 0).sum() >= 2  # not vacuous: several rows move


# --- the step's loss does not depend on how its rows are split ------------------------------------------------------


@pytest.mark.parametrize("name", NEW)
def test_micro_batches_sum_to_the_step_loss_and_metrics(name):
    whole_m = assert_micro_batches_sum_to_the_step(build_objective(name, beta=0.05), seed=5)
    assert whole_m["loss/kl"].item() > 0


@pytest.mark.parametrize("name", NEW)
def test_single_token_fully_masked_and_garbage_padding_rows(name):
    logp = torch.tensor([[-0.7, float("-inf")], [float("nan"), -0.2]], dtype=torch.float64, requires_grad=True)
    batch = micro_batch([1.0, -1.0], [[1, 0], [0, 0]], old_logprobs=[[-0.5, 0.0], [0.0, 0.0]],
                        ref_logprobs=torch.zeros(2, 2))
    loss, m = build_objective(name, beta=0.1).loss(logp, batch, StepTotals(2, 1))
    loss.backward()
    assert loss.isfinite() and all(v.isfinite() for k, v in m.items() if not k.endswith(("_min", "_max")))
    assert logp.grad[0, 0].item() != 0.0
    assert torch.equal(logp.grad[1], torch.zeros(2, dtype=torch.float64)) and logp.grad[0, 1].item() == 0.0
