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

from torch import Tensor

from gpo import ops
from gpo.algorithms.base import BaseObjective, ObjectiveConfig, StdScaledAdvantages
from gpo.registry import register
from gpo.schema import NonNegative, Rate


@dataclass(frozen=True)
class CISPOConfig(ObjectiveConfig, StdScaledAdvantages):
    # Bounds of the detached importance weight, not a clip range of the gradient (so not base.ClipRange's fields).
    epsilon_low: Rate | None = None  # weight clipped below at 1 - epsilon_low; null: no lower bound (paper, TRL)
    epsilon_high: NonNegative = 4.0  # weight capped at 1 + epsilon_high = 5.0 (TRL's recommended cap)
    beta: NonNegative = 0.0  # KL coefficient; 0 loads no reference model


@register("algo", "cispo", config=CISPOConfig)
class CISPO(BaseObjective):
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(ratio)) * A * log pi, weight capped at 5, global token mean."""

    aggregate = staticmethod(ops.token_mean)

    def __init__(self, cfg: CISPOConfig, max_completion_length: int | None = None) -> None:
        super().__init__(cfg, max_completion_length)
        self.weight_min = None if cfg.epsilon_low is None else 1 - cfg.epsilon_low
        self.weight_max = 1 + cfg.epsilon_high

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> ops.Surrogate:
        return ops.clipped_weight_surrogate(logp, old_logp, advantages, weight_min=self.weight_min,
                                            weight_max=self.weight_max)
