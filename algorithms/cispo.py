"""`cispo`: Clipped IS-weight Policy Optimization, from MiniMax-M1 (MiniMax, arXiv 2506.13585).

What changes relative to GRPO: the importance weight is clipped, never the gradient.
- per token, -sg(clip(r, w_min, w_max)) * A * log pi, with r = pi / pi_old. PPO's clip zeroes the gradient of
  tokens whose ratio left the range; those are often the rare "fork" tokens of a reasoning chain. Here every token
  keeps its REINFORCE gradient, only scaled by its (bounded, detached) weight.
- a token-mean loss over the step's global token count (the paper, TRL's `cispo`).
Bounds: w_max = 1 + epsilon_high, w_min = 1 - epsilon_low. The default is the paper's and TRL's: no lower bound
(`epsilon_low: null`; the paper sets a large eps_low) and an upper cap of 5.0 (epsilon_high 4.0; TRL's docs
recommend epsilon_high = 5.0, which in TRL *is* the cap). verl's `cispo` clips both sides with its clip_ratio
(0.2 / 0.2 by default): set `epsilon_low: 0.2, epsilon_high: 0.2` for that.
Unchanged: GRPO's std-scaled group advantages. No KL term (beta 0).
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
class CISPOConfig:
    epsilon_low: float | None = None  # weight clipped below at 1 - epsilon_low; null: no lower bound (paper, TRL)
    epsilon_high: float = 4.0  # weight capped at 1 + epsilon_high = 5.0 (TRL's recommended cap)
    beta: float = 0.0  # KL coefficient; 0 loads no reference model
    kl_estimator: str = "k3"  # used only when beta > 0
    kl_clamp: float | None = None
    is_correction: str = "token"  # token | sequence | none: weigh losses by min(pi_old / pi_sampler, is_cap)
    is_cap: float = 2.0  # truncation of those weights; they apply only with a backend that reports log-probs (vllm)
    std_eps: float = 1e-4  # advantage = (r - mean) / (std + std_eps), TRL's value


@register("algo", "cispo", config=CISPOConfig)
class CISPO:
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(ratio)) * A * log pi, weight capped at 5, global token mean."""

    def __init__(self, cfg: CISPOConfig, mu: int = 1, max_completion_length: int | None = None) -> None:
        if mu < 1:
            raise UserError(f"train.mu (policy updates per generation) must be >= 1, got {mu}.")
        if cfg.epsilon_low is not None and not 0 <= cfg.epsilon_low < 1:
            raise UserError(f"algo.epsilon_low must be in [0, 1) or null (no lower bound), got {cfg.epsilon_low}.")
        if cfg.epsilon_high < 0:
            raise UserError(f"algo.epsilon_high must be >= 0 (the weight cap is 1 + it), got {cfg.epsilon_high}.")
        self.cfg = cfg
        self.weight_min = None if cfg.epsilon_low is None else 1 - cfg.epsilon_low
        self.weight_max = 1 + cfg.epsilon_high
        self.policy_loss = ops.PolicyLoss.with_surrogate(self.surrogate, cfg)
        self.needs_ref_logprobs = cfg.beta > 0
        self.needs_old_logprobs = mu > 1

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> ops.Surrogate:
        return ops.clipped_weight_surrogate(logp, old_logp, advantages, weight_min=self.weight_min,
                                            weight_max=self.weight_max)

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
        return rewards

    def group_filter(self, rewards: Tensor, components: dict[str, Tensor]) -> Tensor:
        return torch.ones(rewards.shape[0], dtype=torch.bool)  # [B]

    def advantages(self, rewards: Tensor) -> Tensor:
        return ops.group_advantages(rewards, scale_by_std=True, eps=self.cfg.std_eps)  # [B, G]

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        return batch.completion_mask

    def loss(self, logp: Tensor, batch: RolloutBatch, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        return self.policy_loss(logp, batch, self.loss_mask(batch), totals, ops.token_mean)
