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

from torch import Tensor

from gpo import ops
from gpo.algorithms.base import BaseObjective, ClipRange, ObjectiveConfig
from gpo.registry import register
from gpo.schema import NonNegative


@dataclass(frozen=True)
class RLOOConfig(ObjectiveConfig, ClipRange):
    # The sequence ratio is clipped to [1 - epsilon_low, 1 + epsilon_high] = [0.8, 1.2] (TRL's RLOOTrainer).
    beta: NonNegative = 0.0  # KL coefficient of a loss term; 0 loads no reference model


@register("algo", "rloo", config=RLOOConfig)
class RLOO(BaseObjective):
    """RLOO (arXiv 2402.14740): leave-one-out baseline r_i - mean(others), one clipped ratio per completion."""

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> ops.Surrogate:
        return ops.sequence_clipped_surrogate(logp, old_logp, advantages, mask, eps_low=self.cfg.epsilon_low,
                                              eps_high=self.cfg.epsilon_high, length_normalised=False)

    def advantages(self, rewards: Tensor) -> Tensor:
        return ops.leave_one_out_advantages(rewards)  # [B, G]
