"""The maths of the GRPO family, as pure functions on tensors.

Symbols: B questions, G completions per question, N = B*G rows, n rows of one micro-batch, L completion length.
Objectives (algorithms/*.py) only choose among these pieces and their settings; nothing here knows a paper's name.

Loss shares. The engine splits the rows of one optimizer step into micro-batches (and ranks) and sums what
`loss` returns over them. So every aggregation below returns this micro-batch's *share* of the step loss: its
numerator is local, its denominator comes from `StepTotals`, counted over the whole step. The loss is then the
same whatever the micro-batch size or the number of ranks. (DDP averages gradients over ranks; the engine undoes
that average, so that shares add up.)

Conventions that differ between peers and are chosen here on purpose (tested in tests/test_trl_equivalence.py):
- advantages: (r - mean) / (std + eps), with a Bessel-corrected std, as in TRL. TRL's eps is 1e-4, verl's 1e-6.
  The eps is a parameter; each objective picks its paper's code value. A group whose rewards are all equal gets
  exactly 0. TRL would give a rounding residue there, such as 1e-13.
- token mean: the denominator is the token count of the whole step (DAPO; TRL's `dapo`, with its normaliser
  tokens/world_size that DDP's mean turns back into tokens). TRL's `bnpo` divides by the micro-batch's own count.
  That agrees with this only when every micro-batch holds the same number of tokens.
- constant normaliser (Dr.GRPO): sum / (totals.sequences * normaliser). TRL's `dr_grpo` divides by
  (micro-batch rows * max_completion_length), which agrees when all micro-batches have the same number of rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from gpo.errors import UserError
from gpo.types import RolloutBatch, StepTotals

KL_ESTIMATORS = ("k1", "k2", "k3")

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


def zero_variance_groups(rewards: Tensor) -> Tensor:
    """[B, G] -> bool [B]: groups whose rewards are all equal (no learning signal)."""
    return (rewards == rewards[:, :1]).all(dim=1)  # [B]


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment, same shape as `lengths`: min(-(len - (Lmax - buf)) / buf * factor, 0).

    0 up to Lmax - buf tokens, then falling linearly to -factor at Lmax.
    """
    if not 0 < buffer <= max_length:
        raise UserError(f"the overlong buffer must be in 1..max_completion_length={max_length}, got {buffer}.")
    excess = lengths.to(torch.float64) - (max_length - buffer)
    return (-excess / buffer * factor).clamp(max=0.0)


def advantage_metrics(rewards: Tensor, advantages: Tensor) -> dict[str, float]:
    """Logged after advantages are computed: [B, G] rewards and advantages -> scalars.

    Stds here are over all B*G values (Bessel-corrected); `zero_std_frac` is the share of groups (not rows)
    whose rewards are all equal.
    """
    adv = advantages.detach().to(torch.float64).flatten()  # [N]
    rew = rewards.detach().to(torch.float64).flatten()  # [N]

    def std(x: Tensor) -> float:
        return x.std().item() if x.numel() > 1 else 0.0

    return {
        "adv/mean": adv.mean().item(),
        "adv/std": std(adv),
        "adv/abs_mean": adv.abs().mean().item(),
        "zero_std_frac": zero_variance_groups(rewards).to(torch.float64).mean().item(),
        "reward/mean": rew.mean().item(),
        "reward/std": std(rew),
    }


# --- per-token terms --------------------------------------------------------------------------------------------


class Surrogate(NamedTuple):
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


IS_LEVELS = ("token", "sequence", "none")


def truncated_is_weights(trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float,
                         level: str = "token") -> tuple[Tensor, Tensor]:
    """Truncated importance weights w = min(pi_old / pi_sampler, cap) for the generator/trainer mismatch.

    A separate generator (vLLM) samples from pi_sampler, which differs slightly from the trainer's pi_old (other
    kernels, precision). Weighting each token's loss by pi_old / pi_sampler makes the gradient that of pi_old's
    samples again; truncating at `cap` bounds its variance (TIS, as verl and TRL apply it).
    `token`: one ratio per token. `sequence`: the product of a row's token ratios, on every token of the row.
    trainer_logp, sampler_logp, mask: [n, L]. Returns (weights [n, L], clipped bool [n, L]), without gradient.
    """
    if level not in IS_LEVELS[:2]:
        raise UserError(f"importance sampling level must be `token` or `sequence`, got `{level}`.")
    m = mask.bool()
    log_ratio = (trainer_logp.detach() - sampler_logp.to(trainer_logp.dtype)).masked_fill(~m, 0.0)  # [n, L]
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)  # [n, L]
    log_cap = math.log(cap)
    # Truncate in log space: a long sequence's product of ratios could overflow before the min.
    weights = torch.exp(log_ratio.clamp(max=log_cap))  # [n, L]
    return weights, (log_ratio > log_cap) & m


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


AGGREGATIONS: dict[str, Aggregation] = {"seq_mean": seq_mean, "token_mean": token_mean}


# --- the loss of the family -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLoss:
    """Clipped surrogate + beta * KL per token, aggregated: the loss shared by GRPO, DAPO and Dr.GRPO.

    The objectives differ in its settings and in the aggregation they pass, never in this code.
    """

    eps_low: float
    eps_high: float
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: float | None = None
    dual_clip: float | None = None
    is_correction: str = "token"  # token | sequence | none; acts only on batches with sampler_logprobs
    is_cap: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.eps_low < 1:
            raise UserError(f"algo.epsilon_low must be in [0, 1), got {self.eps_low}.")
        if self.eps_high < 0:
            raise UserError(f"algo.epsilon_high must be >= 0, got {self.eps_high}.")
        if self.beta < 0:
            raise UserError(f"algo.beta (KL coefficient) must be >= 0, got {self.beta}.")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise UserError(
                f"algo.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got `{self.kl_estimator}`."
            )
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise UserError(f"algo.kl_clamp must be > 0 or null, got {self.kl_clamp}.")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise UserError(f"algo.dual_clip must be > 1 or null (verl uses 3), got {self.dual_clip}.")
        if self.is_correction not in IS_LEVELS:
            raise UserError(f"algo.is_correction must be one of {', '.join(IS_LEVELS)}, got `{self.is_correction}`.")
        if not self.is_cap >= 1:
            raise UserError(f"algo.is_cap (truncation of the importance weights) must be >= 1, got {self.is_cap}.")

    @classmethod
    def from_config(cls, cfg: Any) -> PolicyLoss:
        """From an objective's config; every objective names these settings alike (the errors quote `algo.*`)."""
        return cls(eps_low=cfg.epsilon_low, eps_high=cfg.epsilon_high, beta=cfg.beta,
                   kl_estimator=cfg.kl_estimator, kl_clamp=cfg.kl_clamp, dual_clip=cfg.dual_clip,
                   is_correction=cfg.is_correction, is_cap=cfg.is_cap)

    def __call__(
        self, logp: Tensor, batch: RolloutBatch, mask: Tensor, totals: StepTotals, aggregate: Aggregation,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """logp [n, L] of the current policy on the micro-batch's rows -> (loss share, metric shares).

        Metrics are detached 0-dim tensors. Summed over micro-batches they give the step value, except names
        ending in `_min` / `_max` (the smallest and largest token ratio), which the engine reduces with min / max;
        they are +inf / -inf when no token counts, the identities of those reductions.
        """
        m = mask.bool()  # [n, L]
        # Padding may hold anything (even -inf); zero it so no NaN reaches the loss or its gradient.
        logp = logp.masked_fill(~m, 0.0)
        old = logp.detach() if batch.old_logprobs is None else batch.old_logprobs.masked_fill(~m, 0.0)
        surrogate = clipped_surrogate(
            logp, old, batch.advantages, eps_low=self.eps_low, eps_high=self.eps_high, dual_clip=self.dual_clip
        )
        per_token = surrogate.loss  # [n, L]
        tokens = max(totals.tokens, 1)
        metrics = {}
        if self.is_correction != "none" and batch.sampler_logprobs is not None:
            weights, clipped = truncated_is_weights(old, batch.sampler_logprobs, m, self.is_cap, self.is_correction)
            per_token = per_token * weights
            metrics["is/weight_mean"] = torch.where(m, weights, 0.0).sum() / tokens
            metrics["is/clipped_frac"] = clipped.sum() / tokens
        policy = aggregate(per_token, m, totals)
        metrics |= {
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
