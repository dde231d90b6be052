"""`gspo`: Group Sequence Policy Optimization (Zheng et al., Qwen team, arXiv 2507.18071).

What changes relative to GRPO: the importance ratio and its clip are per sequence, not per token.
- s_i = exp(mean over the sequence's tokens of log(pi / pi_old)): the length-normalised sequence likelihood ratio.
  Token ratios fluctuate with each token's noise; their geometric mean does not, and a reward is given to a whole
  sequence, so the off-policy correction is made at the same level.
- one clipped term per sequence, max(-A*s_i, -A*clip(s_i, 1 - 3e-4, 1 + 4e-4)), and a sequence-mean loss. The clip
  range is that narrow because s_i is a per-token geometric mean (the paper's 3e-4 / 4e-4).
- the gradient flows through s_i. The paper's token-level form GSPO-token, s_i,t = sg(s_i) * pi_t / sg(pi_t),
  has the same value and the same gradient (tested), so it is not a separate option.
Unchanged: GRPO's std-scaled group advantages. No KL term (beta 0), as in the paper's runs.
Peers: TRL (`importance_sampling_level="sequence"`, `loss_type="grpo"`) computes exactly this; verl's `gspo`
uses the token-level form and clamps log s_i at 10 for stability, which gpo does not (exp(10) is still finite).
With mu = 1, s_i = 1 and GSPO's gradient is GRPO's sequence-mean one.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from gpo import ops
from gpo.algorithms.base import BaseObjective, ClipRange, ObjectiveConfig, StdScaledAdvantages
from gpo.registry import register
from gpo.schema import NonNegative, Rate


@dataclass(frozen=True)
class GSPOConfig(ObjectiveConfig, ClipRange, StdScaledAdvantages):
    epsilon_low: Rate = 3e-4  # sequence ratio clipped below at 1 - epsilon_low (paper)
    epsilon_high: NonNegative = 4e-4  # and above at 1 + epsilon_high (paper)
    beta: NonNegative = 0.0  # KL coefficient; 0 loads no reference model


@register("algo", "gspo", config=GSPOConfig)
class GSPO(BaseObjective):
    """GSPO (arXiv 2507.18071): one clipped ratio per sequence (geometric mean of its token ratios), clip 3e-4/4e-4."""

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> ops.Surrogate:
        return ops.sequence_clipped_surrogate(logp, old_logp, advantages, mask, eps_low=self.cfg.epsilon_low,
                                              eps_high=self.cfg.epsilon_high)
