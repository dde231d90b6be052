"""`rloo`: REINFORCE Leave-One-Out ("Back to Basics", Ahmadian et al., arXiv 2402.14740; Kool et al. 2019).

What changes relative to GRPO: the baseline, and the completion as one action.
- A_i = r_i - mean of the other G - 1 rewards of the group, unscaled: each sample's baseline is independent of
  it, so the REINFORCE estimate stays unbiased (GRPO's own-group mean and std division are not).
  Equal to G / (G - 1) * (r_i - group mean).
- the whole completion is one action: one ratio per sequence, pi(y) / pi_old(y) (the product of its token
  ratios), clipped to [1 - 0.2, 1 + 0.2], one term per sequence, averaged over sequences. On-policy (mu = 1) the
  gradient is the paper's A_i * grad log pi(y_i) (a token sum, not GRPO's token mean). This is TRL's RLOOTrainer
  loss; verl's `rloo` is an advantage estimator only, used with its token-level PPO loss. With mu > 1 a long
  completion's ratio leaves the clip range after small per-token changes, as in TRL; with mu = 1 it is exactly 1.
No KL term by default. The paper and TRL (beta 0.05) subtract a k1 KL from the reward; gpo's `beta` is a KL term
in the loss, as in GRPO, averaged per sequence.
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
class RLOOConfig:
    epsilon_low: float = 0.2  # sequence ratio clipped below at 1 - epsilon_low (TRL's RLOOTrainer)
    epsilon_high: float = 0.2  # and above at 1 + epsilon_high
    beta: float = 0.0  # KL coefficient of a loss term; 0 loads no reference model
    kl_estimator: str = "k3"  # used only when beta > 0
    kl_clamp: float | None = None
    is_correction: str = "token"  # token | sequence | none: weigh losses by min(pi_old / pi_sampler, is_cap)
    is_cap: float = 2.0  # truncation of those weights; they apply only with a backend that reports log-probs (vllm)


@register("algo", "rloo", config=RLOOConfig)
class RLOO:
    """RLOO (arXiv 2402.14740): leave-one-out baseline r_i - mean(others), one clipped ratio per completion."""

    def __init__(self, cfg: RLOOConfig, mu: int = 1, max_completion_length: int | None = None) -> None:
        if mu < 1:
            raise UserError(f"train.mu (policy updates per generation) must be >= 1, got {mu}.")
        ops.check_clip_range(cfg.epsilon_low, cfg.epsilon_high)
        self.cfg = cfg
        self.policy_loss = ops.PolicyLoss.with_surrogate(self.surrogate, cfg)
        self.needs_ref_logprobs = cfg.beta > 0
        self.needs_old_logprobs = mu > 1

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> ops.Surrogate:
        return ops.sequence_clipped_surrogate(logp, old_logp, advantages, mask, eps_low=self.cfg.epsilon_low,
                                              eps_high=self.cfg.epsilon_high, length_normalised=False)

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
        return rewards

    def group_filter(self, rewards: Tensor, components: dict[str, Tensor]) -> Tensor:
        return torch.ones(rewards.shape[0], dtype=torch.bool)  # [B]

    def advantages(self, rewards: Tensor) -> Tensor:
        return ops.leave_one_out_advantages(rewards)  # [B, G]

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        return batch.completion_mask

    def loss(self, logp: Tensor, batch: RolloutBatch, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        return self.policy_loss(logp, batch, self.loss_mask(batch), totals, ops.seq_mean)
