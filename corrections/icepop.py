"""`icepop`: IcePop's two-sided token masking (Ling Team's IcePop blog post, then their Ring-1T technical report,
"Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model").

Each token's ratio rho = pi_old / pi_generator must lie in [alpha, beta] (the paper's 0.5 and 5): inside, the token
keeps its loss weighted by rho; outside, it is masked out of the gradient. verl's rollout correction (token
rejection over a two-sided band) and OpenRLHF's `icepop` option apply this rule. It is `mis` at token level with
the ratio weight, IcePop's band as defaults.

Where gpo differs: the masked tokens also leave the loss's denominators (gpo.step_math.step_totals); the ratio is
pi_old / pi_generator with pi_old the trainer's log-probs of the step's old policy, as in `tis` and `mis`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from gpo.corrections.mis import Lower, Upper, check_band, masked_weights
from gpo.registry import register
from gpo.types import Corrected


@dataclass(frozen=True)
class IcePopConfig:
    """Tokens whose pi_old / pi_generator leaves [lower, upper] are masked; the others are weighted by it."""

    lower: Lower = 0.5  # IcePop's alpha
    upper: Upper = 5.0  # IcePop's beta

    def __post_init__(self) -> None:
        check_band(self.lower, self.upper, "correction")


@register("correction", "icepop", config=IcePopConfig)
class IcePop:
    """IcePop: mask tokens whose pi_old / pi_generator leaves [lower, upper], weigh the rest by it."""

    masks = True

    def __init__(self, cfg: IcePopConfig) -> None:
        self.cfg = cfg

    def correct(self, old_logprobs: Tensor, generator_logprobs: Tensor, loss_mask: Tensor) -> Corrected:
        return masked_weights(old_logprobs, generator_logprobs, loss_mask, self.cfg.lower, self.cfg.upper, "token",
                              True)
