"""`sapo`: Soft Adaptive Policy Optimization (arXiv 2511.20347).

What changes relative to GRPO: a smooth gate in place of the hard clip.
- per token, -f(r) * A with f(r) = (4 / tau) * sigmoid(tau * (r - 1)), r = pi / pi_old. Its gradient is
  A * sech^2(tau (r - 1) / 2) * r * grad log pi: GRPO's at r = 1, fading smoothly as r moves away instead of
  dropping to zero at a clip edge, so a few off-policy tokens are damped without discarding the whole step.
- tau_pos = 1.0 where A > 0 and tau_neg = 1.05 otherwise: negative updates, which spread probability mass over many
  tokens and destabilise training more, fade faster. These are TRL's and verl's defaults (the paper's setting).
- a sequence-mean loss (TRL's `sapo` aggregates as its `grpo`; verl's as seq-mean-token-mean).
Unchanged: GRPO's std-scaled group advantages. No KL term (beta 0). verl clamps log r to [-20, 20] before the
exp; TRL and gpo do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from gpo import ops
from gpo.algorithms.base import BaseObjective, ObjectiveConfig, StdScaledAdvantages
from gpo.registry import register
from gpo.schema import NonNegative, Positive


@dataclass(frozen=True)
class SAPOConfig(ObjectiveConfig, StdScaledAdvantages):
    tau_pos: Positive = 1.0  # gate temperature for tokens with A > 0
    tau_neg: Positive = 1.05  # and for tokens with A <= 0 (larger: their updates fade faster)
    beta: NonNegative = 0.0  # KL coefficient; 0 loads no reference model


@register("algo", "sapo", config=SAPOConfig)
class SAPO(BaseObjective):
    """SAPO (arXiv 2511.20347): the soft gate (4/tau) sigmoid(tau (ratio - 1)) for the clip; tau 1.0 / 1.05."""

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> ops.Surrogate:
        return ops.soft_gate_surrogate(logp, old_logp, advantages, tau_pos=self.cfg.tau_pos, tau_neg=self.cfg.tau_neg)
