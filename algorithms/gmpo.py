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

from torch import Tensor

from gpo import ops
from gpo.algorithms.base import BaseObjective, ClipRange, ObjectiveConfig, StdScaledAdvantages
from gpo.registry import register
from gpo.schema import NonNegative


@dataclass(frozen=True)
class GMPOConfig(ObjectiveConfig, ClipRange, StdScaledAdvantages):
    # The bounds are on the log ratio, so any eps >= 0 is a valid range (it keeps r_t within (e^-eps, e^eps)).
    epsilon_low: NonNegative = 0.4  # log ratio clipped below at -epsilon_low where A < 0 (paper)
    epsilon_high: NonNegative = 0.4  # and above at epsilon_high where A > 0 (paper)
    beta: NonNegative = 0.0  # KL coefficient; 0 loads no reference model
    std_eps: NonNegative = 1e-6  # verl's value (the authors' code)


@register("algo", "gmpo", config=GMPOConfig)
class GMPO(BaseObjective):
    """GMPO (arXiv 2507.20673): -A * geometric mean of the token ratios, log ratios clipped to [-0.4, 0.4]."""

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> ops.Surrogate:
        return ops.geometric_mean_surrogate(logp, old_logp, advantages, mask, eps_low=self.cfg.epsilon_low,
                                            eps_high=self.cfg.epsilon_high)
