"""The maths of the GRPO family, as pure functions on tensors.

Symbols: B questions, G completions per question, N = B*G rows, n rows of one micro-batch, L completion length.
Objectives (algorithms/*.py) only choose among these pieces and their settings; nothing here knows a paper's name.

Loss shares. The engine splits the rows of one optimizer step into micro-batches (and ranks) and sums what
`loss` returns over them. So every aggregation below returns this micro-batch's *share* of the step loss: its
numerator is local, its denominator comes from `StepTotals`, counted over the whole step. The loss is then the
same whatever the micro-batch size or the number of ranks. (DDP averages gradients over ranks; the engine undoes
that average, so that shares add up.)

Conventions that differ between peers and are chosen here on purpose (tested in tests/unit/test_trl_equivalence.py):
- advantages: (r - mean) / (std + eps), with a Bessel-corrected std, as in TRL. TRL's eps is 1e-4, verl's 1e-6.
  The eps is a parameter; each objective picks its paper's code value. A group whose rewards are all equal gets
  exactly 0. TRL would give a rounding residue there, such as 1e-13.
- token mean: the denominator is the token count of the whole step (DAPO; TRL's `dapo`, with its normaliser
  tokens/world_size that DDP's mean turns back into tokens). TRL's `bnpo` divides by the micro-batch's own count.
  That agrees with this only when every micro-batch holds the same number of tokens.
- constant normaliser (Dr.GRPO): sum / (totals.sequences * normaliser). TRL's `dr_grpo` divides by
  (micro-batch rows * max_completion_length), which agrees when all micro-batches have the same number of rows.
- batch whitening (REINFORCE++): over the B*G sequences. verl's `masked_whiten` runs over tokens, so a sequence
  weighs as many times as it has tokens (tests/unit/test_objectives_family.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, get_args

import torch
from torch import Tensor

from gpo.errors import UserError
from gpo.types import RolloutBatch, StepTotals

KLEstimator = Literal["k1", "k2", "k3"]  # the type of a config field that names one
KL_ESTIMATORS = get_args(KLEstimator)

# --- advantages -------------------------------------------------------------------------------------------------


def group_advantages(rewards: Tensor, *, scale_by_std: bool = True, eps: float = 1e-4) -> Tensor:
    """[B, G] rewards -> [B, G] advantages: reward minus its group's mean, divided by (std + eps) if asked.

    The std is Bessel-corrected (divides by G - 1), as TRL's and verl's are. Groups whose rewards are all equal
    carry no signal and get exactly 0, never NaN, even with eps = 0.
    """
    if rewards.dim() != 2:
        raise UserError(f"rewards must be [B, G]; got shape {tuple(rewards.shape)}.")
    if rewards.shape[1] < 2:
        raise UserError(
            f"group-relative methods need G >= 2 completions per question (got G = {rewards.shape[1]}): "
            "with one completion the group mean is the reward itself. Raise train.group_size."
        )
    if eps < 0:
        raise UserError(f"the advantage epsilon must be >= 0, got {eps}.")
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # [B, G]
    if scale_by_std:
        centred = centred / (rewards.std(dim=1, keepdim=True) + eps)  # std: [B, 1]
    flat = zero_variance_groups(rewards).unsqueeze(1)  # [B, 1]
    # The mean of equal floats can differ from them in the last bit; zero such groups exactly.
    return centred.masked_fill(flat, 0.0)


def leave_one_out_advantages(rewards: Tensor) -> Tensor:
    """RLOO: [B, G] rewards -> [B, G] advantages r_i - mean of the other G - 1 rewards of the group.

    Equal to G / (G - 1) * (r_i - group mean): GRPO's unscaled advantage, stretched. Flat groups get exactly 0.
    """
    group_advantages(rewards, scale_by_std=False)  # the same checks of shape and G
    G = rewards.shape[1]
    baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (G - 1)  # [B, G]
    return (rewards - baseline).masked_fill(zero_variance_groups(rewards).unsqueeze(1), 0.0)


def batch_whiten(advantages: Tensor, eps: float = 1e-8) -> Tensor:
    """[B, G] -> [B, G]: (A - mean) / sqrt(var + eps), mean and Bessel-corrected var over all B*G values.

    REINFORCE++'s global normalisation (verl's `masked_whiten` formula, over sequences rather than tokens).
    Values of groups whose advantages are all 0 (no signal) stay exactly 0: the batch mean of group-centred
    advantages is 0 but for rounding, which would otherwise leak into them.
    """
    if advantages.numel() < 2:
        raise UserError(f"batch whitening needs at least 2 advantages, got {advantages.numel()}.")
    flat = (advantages == 0).all(dim=1, keepdim=True)  # [B, 1]
    whitened = (advantages - advantages.mean()) * torch.rsqrt(advantages.var() + eps)  # var: Bessel-corrected
    return whitened.masked_fill(flat, 0.0)


def zero_variance_groups(rewards: Tensor, tolerance: float = 0.0) -> Tensor:
    """[B, G] -> bool [B]: groups with no learning signal, their rewards equal within `tolerance` (max - min).

    The one definition of "no variance": group-relative advantages are (r - mean) / (std + eps), so such a group
    trains nothing. Binary rewards make it exact; graded rewards (a format bonus) may use a tolerance."""
    if rewards.shape[1] < 2:
        return torch.ones(rewards.shape[0], dtype=torch.bool)
    return (rewards.amax(dim=1) - rewards.amin(dim=1)) <= tolerance  # [B]


def no_variance(rewards: Tensor, tolerance: float = 0.0) -> bool:
    """One question's rewards [n], of any count, by the same rule (a single reward or none has no variance)."""
    return rewards.numel() < 2 or bool(zero_variance_groups(rewards.reshape(1, -1), tolerance)[0])


def group_index(batch: RolloutBatch) -> tuple[Tensor, Tensor]:
    """(index [N] in 0..groups-1 in order of appearance, size [groups]), checking that groups are contiguous."""
    ids = batch.group_ids
    if len(ids) == 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    starts = torch.ones(len(ids), dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    index = torch.cumsum(starts.long(), 0) - 1  # [N]
    if int(starts.sum()) != len(torch.unique(ids)):
        raise UserError("batch.group_ids: the rows of a question must be contiguous (a group id reappears later).")
    return index, torch.bincount(index)


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment, same shape as `lengths`: min(-(len - (Lmax - buf)) / buf * factor, 0).

    0 up to Lmax - buf tokens, then falling linearly to -factor at Lmax.
    """
    if not 0 < buffer <= max_length:
        raise UserError(f"the overlong buffer must be in 1..max_completion_length={max_length}, got {buffer}.")
    excess = lengths.to(torch.float64) - (max_length - buffer)
    return (-excess / buffer * factor).clamp(max=0.0)


# --- per-token terms --------------------------------------------------------------------------------------------


class Surrogate(NamedTuple):
    """Per-token terms of a policy loss. The flags are PPO's clip's, as written here; the other surrogates below
    say in their docstrings what their flags mark."""

    loss: Tensor  # [n, L] per-token policy loss (to be minimised)
    ratio: Tensor  # [n, L] pi / pi_old
    low_clipped: Tensor  # bool [n, L]: A < 0 and ratio < 1 - eps_low (no gradient flows)
    high_clipped: Tensor  # bool [n, L]: A > 0 and ratio > 1 + eps_high
    dual_clipped: Tensor  # bool [n, L]: A < 0 and the loss capped at -A*c


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, *, eps_low: float, eps_high: float,
    dual_clip: float | None = None,
) -> Surrogate:
    """PPO's clipped objective per token, negated into a loss: max(-A*r, -A*clip(r, 1-eps_low, 1+eps_high)).

    `dual_clip` = c (> 1) also caps the loss of negative-advantage tokens at -A*c, as verl does. Otherwise a token
    whose ratio has grown far above 1 can dominate the step.
    logp, old_logp: [n, L]; advantages: [n].
    """
    ratio = torch.exp(logp - old_logp)  # [n, L]
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [n, 1]
    return _clipped_terms(ratio, adv, eps_low, eps_high, dual_clip)


def _clipped_terms(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None) -> Surrogate:
    """The clipped loss of `ratio` ([n, L], or [n, 1] for one ratio per sequence) with advantages [n, 1]."""
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))  # [n, L]
    low = (ratio < 1 - eps_low) & (adv < 0)  # [n, L]
    high = (ratio > 1 + eps_high) & (adv > 0)  # [n, L]
    if dual_clip is None:
        dual = torch.zeros_like(low)  # [n, L]
    else:
        cap = -adv * dual_clip  # [n, 1]
        dual = (adv < 0) & (loss > cap)  # [n, L]
        loss = torch.where(dual, cap, loss)
    return Surrogate(loss, ratio, low, high, dual)


def _expand(row: Tensor, like: Tensor) -> Tensor:
    """[n] or [n, 1] -> [n, L]: one value per sequence on each of its tokens. The sequence-mean aggregation of the
    expanded values gives back the row's value and, through autograd's sum over the copies, its gradient."""
    return row.reshape(-1, 1).expand_as(like)


def sequence_clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, eps_low: float, eps_high: float,
    length_normalised: bool = True,
) -> Surrogate:
    """One clipped ratio per sequence: max(-A*s, -A*clip(s, 1-eps_low, 1+eps_high)) on each of its tokens.

    `length_normalised`: s = exp(mean over the sequence's tokens of log(pi / pi_old)), GSPO's length-normalised
    ratio (the geometric mean of the token ratios). Otherwise s = pi(y) / pi_old(y), the ratio of the whole
    sequence's likelihood (the product of the token ratios; TRL's RLOO trainer). The gradient flows through s, so
    with a sequence-mean aggregation each token of row i gets -A_i * ds_i / d logp_t, the same as GSPO's
    token-level form sg(s_i) * pi_t / sg(pi_t).
    logp, old_logp, mask: [n, L]; advantages: [n]. The returned ratio and clip flags are the row's, on every token.
    """
    m = mask.bool()
    log_ratio = torch.where(m, logp - old_logp, 0.0).sum(dim=1)  # [n]
    if length_normalised:
        log_ratio = log_ratio / m.sum(dim=1).clamp(min=1)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [n, 1]
    rows = _clipped_terms(torch.exp(log_ratio).unsqueeze(1), adv, eps_low, eps_high, None)  # each [n, 1]
    return Surrogate(*(_expand(x, logp) for x in rows))


def clipped_weight_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, *, weight_min: float | None, weight_max: float,
) -> Surrogate:
    """CISPO's per-token loss -sg(clip(r, weight_min, weight_max)) * A * log pi: the weight is clipped, not the
    gradient, so every token keeps its REINFORCE gradient (scaled by the clipped weight).

    `weight_min` None: no lower bound (the paper and TRL). Flags: `high_clipped` where r > weight_max and
    `low_clipped` where r < weight_min, whatever the advantage's sign (the weight is capped either way).
    logp, old_logp: [n, L]; advantages: [n].
    """
    ratio = torch.exp(logp - old_logp)  # [n, L]
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [n, 1]
    weight = ratio.clamp(min=weight_min, max=weight_max).detach()  # [n, L]
    low = ratio < weight_min if weight_min is not None else torch.zeros_like(ratio, dtype=torch.bool)
    return Surrogate(-weight * adv * logp, ratio, low, ratio > weight_max, torch.zeros_like(low))


def soft_gate_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, *, tau_pos: float, tau_neg: float,
) -> Surrogate:
    """SAPO's per-token loss -f(r) * A with the smooth gate f(r) = (4 / tau) * sigmoid(tau * (r - 1)).

    tau = tau_pos where A > 0, tau_neg otherwise. f(1) = 2 / tau and f'(1) = 1, so on-policy the gradient is
    GRPO's; off-policy it fades smoothly instead of stopping at a clip edge. Nothing is clipped (flags all false).
    logp, old_logp: [n, L]; advantages: [n].
    """
    ratio = torch.exp(logp - old_logp)  # [n, L]
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [n, 1]
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))  # [n, 1], in logp's precision
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)  # [n, L]
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return Surrogate(-gate * adv, ratio, none, none, none)


def geometric_mean_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, eps_low: float, eps_high: float,
) -> Surrogate:
    """GMPO's sequence loss -A * exp(mean_t clip(log r_t)) on each of the sequence's tokens.

    The log ratios are clipped before the mean, sign-aware as a PPO clip is: where A > 0 only the upper bound
    eps_high binds (log r_t > eps_high counts as eps_high and passes no gradient), where A < 0 only the lower bound
    -eps_low. The bounds are in log space: eps 0.4 keeps r_t within (e^-0.4, e^0.4).
    logp, old_logp, mask: [n, L]; advantages: [n]. `ratio` is the token ratio; the flags mark clipped tokens.
    """
    m = mask.bool()
    log_ratio = logp - old_logp  # [n, L]
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [n, 1]
    high = (adv > 0) & (log_ratio > eps_high)  # [n, L]
    low = (adv < 0) & (log_ratio < -eps_low)  # [n, L]
    # A = 0: both bounds, which changes nothing in a zero loss but keeps exp() finite.
    bounded = torch.where(adv > 0, log_ratio.clamp(max=eps_high),
                          torch.where(adv < 0, log_ratio.clamp(min=-eps_low), log_ratio.clamp(-eps_low, eps_high)))
    mean_log = torch.where(m, bounded, 0.0).sum(dim=1) / m.sum(dim=1).clamp(min=1)  # [n]
    loss = -adv.squeeze(1) * torch.exp(mean_log)  # [n]
    return Surrogate(_expand(loss, logp), torch.exp(log_ratio), low, high, torch.zeros_like(low))


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3", clamp: float | None = None) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3), same shape as logp.

    With x = ref_logp - logp:  k1 = -x,  k2 = x^2 / 2,  k3 = exp(x) - x - 1 (unbiased, always >= 0; GRPO's).
    `clamp` bounds the estimate to [-clamp, clamp] (verl's `low_var_kl` is k3 clamped to 10).
    """
    x = ref_logp - logp
    if estimator == "k1":
        kl = -x
    elif estimator == "k2":
        kl = 0.5 * x.square()
    elif estimator == "k3":
        kl = torch.exp(x) - x - 1
    else:
        raise UserError(f"unknown KL estimator `{estimator}`; choose one of {', '.join(KL_ESTIMATORS)}.")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


# --- aggregation: a micro-batch's share of the step loss ---------------------------------------------------------

Aggregation = Callable[[Tensor, Tensor, StepTotals], Tensor]


def seq_mean(loss: Tensor, mask: Tensor, totals: StepTotals) -> Tensor:
    """GRPO paper: mean over sequences of each sequence's token mean. Share = sum_i(token-mean_i) / sequences.

    Each sequence weighs the same however long it is, so tokens of long answers weigh less (the length bias
    Dr.GRPO removes). A row with no loss tokens contributes 0.
    """
    m = mask.bool()
    per_row = torch.where(m, loss, 0.0).sum(dim=1) / m.sum(dim=1).clamp(min=1)  # [n]
    return per_row.sum() / max(totals.sequences, 1)


def token_mean(loss: Tensor, mask: Tensor, totals: StepTotals) -> Tensor:
    """DAPO: every token of the step weighs the same. Share = sum_{i,t} m*l / tokens (global count)."""
    return torch.where(mask.bool(), loss, 0.0).sum() / max(totals.tokens, 1)


def token_sum_norm(loss: Tensor, mask: Tensor, totals: StepTotals, normaliser: int) -> Tensor:
    """Dr.GRPO: token sums divided by a constant. Share = sum_{i,t} m*l / (sequences * normaliser)."""
    return torch.where(mask.bool(), loss, 0.0).sum() / (max(totals.sequences, 1) * normaliser)


LossAggregation = Literal["seq_mean", "token_mean"]  # the aggregations a config can name (`AGGREGATIONS`)
AGGREGATIONS: dict[str, Aggregation] = {"seq_mean": seq_mean, "token_mean": token_mean}


# --- the loss of the family -------------------------------------------------------------------------------------


SurrogateFn = Callable[[Tensor, Tensor, Tensor, Tensor], Surrogate]  # (logp, old_logp, advantages, mask)


@dataclass(frozen=True)
class PolicyLoss:
    """Surrogate + beta * KL per token, aggregated: the loss shared by every objective.

    The surrogate is PPO's clipped ratio with eps_low / eps_high (GRPO, DAPO, Dr.GRPO, REINFORCE++) unless
    `surrogate` gives another per-token term (GSPO, CISPO, SAPO, GMPO, RLOO); KL, aggregation and metrics are the
    same for all. The objectives differ in these settings, never in this code. The generator/trainer correction is
    not an objective's setting: it comes with the batch (`is_weights` multiply each token's policy loss, `is_mask`
    takes tokens out of the mask), so every objective composes with every correction (gpo.corrections).
    """

    eps_low: float | None = None  # the clipped ratio's bounds; unused (None) with `surrogate`
    eps_high: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: float | None = None
    dual_clip: float | None = None
    surrogate: SurrogateFn | None = None  # another objective's per-token term, e.g. partial(soft_gate_surrogate, ...)

    def __post_init__(self) -> None:
        # Each setting's range is its config field's annotation (algorithms/base.py), checked when composing; only
        # the rule between two settings is checked here.
        if self.surrogate is not None and self.dual_clip is not None:
            raise UserError("algo.dual_clip applies to the clipped ratio only; this objective has its own surrogate.")

    @classmethod
    def from_config(cls, cfg: Any) -> PolicyLoss:
        """From an objective's config; every objective names these settings alike (the errors quote `algo.*`)."""
        return cls(eps_low=cfg.epsilon_low, eps_high=cfg.epsilon_high, beta=cfg.beta,
                   kl_estimator=cfg.kl_estimator, kl_clamp=cfg.kl_clamp, dual_clip=cfg.dual_clip)

    @classmethod
    def with_surrogate(cls, surrogate: SurrogateFn, cfg: Any) -> PolicyLoss:
        """Another per-token term, with the KL settings of an objective's config."""
        return cls(beta=cfg.beta, kl_estimator=cfg.kl_estimator, kl_clamp=cfg.kl_clamp, surrogate=surrogate)

    def __call__(
        self, logp: Tensor, batch: RolloutBatch, mask: Tensor, totals: StepTotals, aggregate: Aggregation,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """logp [n, L] of the current policy on the micro-batch's rows -> (loss share, metric shares).

        Metrics are detached 0-dim tensors. Summed over micro-batches they give the step value, except names
        ending in `_min` / `_max` (the smallest and largest token ratio), which the engine reduces with min / max;
        they are +inf / -inf when no token counts, the identities of those reductions.
        Tokens the correction dropped (`batch.is_mask`) leave `mask`, as they left `totals` (gpo.step_math).
        """
        m = batch.counted(mask)  # [n, L]
        # Padding may hold anything (even -inf); zero it so no NaN reaches the loss or its gradient.
        logp = logp.masked_fill(~m, 0.0)
        old = logp.detach() if batch.old_logprobs is None else batch.old_logprobs.masked_fill(~m, 0.0)
        if self.surrogate is None:
            assert self.eps_low is not None and self.eps_high is not None  # the clipped ratio needs its bounds
            surrogate = clipped_surrogate(
                logp, old, batch.advantages, eps_low=self.eps_low, eps_high=self.eps_high, dual_clip=self.dual_clip
            )
        else:
            surrogate = self.surrogate(logp, old, batch.advantages, m)
        per_token = surrogate.loss  # [n, L]
        if batch.is_weights is not None:  # the generator/trainer correction's weights, without gradient
            per_token = per_token * batch.is_weights.to(per_token)
        tokens = max(totals.tokens, 1)
        policy = aggregate(per_token, m, totals)
        metrics = {
            "clip/low_frac": (surrogate.low_clipped & m).sum() / tokens,
            "clip/high_frac": (surrogate.high_clipped & m).sum() / tokens,
            "ratio/mean": torch.where(m, surrogate.ratio, 0.0).sum() / tokens,
            "ratio/token_min": surrogate.ratio[m].min() if m.any() else logp.new_tensor(math.inf),
            "ratio/token_max": surrogate.ratio[m].max() if m.any() else logp.new_tensor(-math.inf),
            "loss/policy": policy,
        }
        if self.dual_clip is not None:
            metrics["clip/dual_frac"] = (surrogate.dual_clipped & m).sum() / tokens
        if self.beta > 0:
            if batch.ref_logprobs is None:
                raise ValueError("beta > 0 but the batch has no ref_logprobs: the engine must compute them.")
            kl = kl_penalty(logp, batch.ref_logprobs.masked_fill(~m, 0.0), self.kl_estimator, self.kl_clamp)
            kl_share = aggregate(self.beta * kl, m, totals)
            metrics["kl/mean"] = torch.where(m, kl, 0.0).sum() / tokens
        else:
            kl_share = policy.new_zeros(())
        metrics["loss/kl"] = kl_share
        return policy + kl_share, {k: v.detach() for k, v in metrics.items()}
