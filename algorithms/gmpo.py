"""`gmpo`: Geometric-Mean Policy Optimization (arXiv 2507.20673).

What changes relative to GRPO: each sequence's term uses the geometric mean of its token ratios instead of their
arithmetic mean.
- loss_i = -A_i * exp(mean_t clip(log r_t)), one term per sequence, averaged over sequences. An outlier token ratio
  moves a geometric mean far less than an arithmetic one, so the objective's range is narrower and updates are
  steadier, which lets the clip be wider.
- the clip acts on each token's log ratio before the mean, sign-aware as PPO's: with A > 0 only log r_t > eps
  is clipped, with A < 0 only log r_t < -eps. Its range is in log space: the paper's eps = 0.4 keeps r_t in
  (e^-0.4, e^0.4) = (0.67, 1.49), wider than GRPO's (0.8, 1.2).
Unchanged: std-scaled group advantages (eps 1e-6, the value of the authors' verl-based code). No KL term (beta 0).
This is verl's `geo_mean` policy loss. verl divides by the micro-batch's row count; gpo by the step's sequences
(equal for one micro-batch, and the same sum over equal-sized ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gpo import ops
from gpo.errors import UserError
from gpo.registry import register
from gpo.types import RolloutBatch, StepTotals


@dataclass
class GMPOConfig:
    epsilon_low: float = 0.4  # log ratio clipped below at -epsilon_low where A < 0 (paper)
    epsilon_high: float = 0.4  # and above at epsilon_high where A > 0 (paper)
    beta: float = 0.0  # KL coefficient; 0 loads no reference model
    kl_estimator: str = "k3"  # used only when beta > 0
    kl_clamp: float | None = None
    is_correction: str = "token"  # token | sequence | none: weigh losses by min(pi_old / pi_sampler, is_cap)
    is_cap: float = 2.0  # truncation of those weights; they apply only with a backend that reports log-probs (vllm)
    std_eps: float = 1e-6  # advantage = (r - mean) / (std + std_eps), verl's value (the authors' code)


@register("algo", "gmpo", config=GMPOConfig)
class GMPO:
    """GMPO (arXiv 2507.20673): -A * geometric mean of the token ratios, log ratios clipped to [-0.4, 0.4]."""

    def __init__(self, cfg: GMPOConfig, mu: int = 1, max_completion_length: int | None = None) -> None:
        if mu < 1:
            raise UserError(f"train.mu (policy updates per generation) must be >= 1, got {mu}.")
        for key in ("epsilon_low", "epsilon_high"):  # log-space bounds: any eps >= 0 is a valid range
            if not getattr(cfg, key) >= 0:
                raise UserError(f"algo.{key} (a bound on the log ratio) must be >= 0, got {getattr(cfg, key)}.")
        self.cfg = cfg
        self.policy_loss = ops.PolicyLoss.with_surrogate(self.surrogate, cfg)
        self.needs_ref_logprobs = cfg.beta > 0
        self.needs_old_logprobs = mu > 1

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> ops.Surrogate:
        return ops.geometric_mean_surrogate(logp, old_logp, advantages, mask, eps_low=self.cfg.epsilon_low,
                                            eps_high=self.cfg.epsilon_high)

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
        return rewards

    def group_filter(self, rewards: Tensor, components: dict[str, Tensor]) -> Tensor:
        return torch.ones(rewards.shape[0], dtype=torch.bool)  # [B]

    def advantages(self, rewards: Tensor) -> Tensor:
        return ops.group_advantages(rewards, scale_by_std=True, eps=self.cfg.std_eps)  # [B, G]

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        return batch.completion_mask

    def loss(self, logp: Tensor, batch: RolloutBatch, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        return self.policy_loss(logp, batch, self.loss_mask(batch), totals, ops.seq_mean)
