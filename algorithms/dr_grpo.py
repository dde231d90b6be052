"""`dr_grpo`: Dr. GRPO, "Understanding R1-Zero-Like Training: A Critical Perspective" (Liu et al., arXiv 2503.20783).

It removes GRPO's two normalisations, which bias optimisation:
- advantages are r - mean(group), with no division by the group's std. The std division over-weights questions
  that are almost always right or almost always wrong.
- the loss sums token losses and divides by a constant (the maximum completion length), instead of each
  sequence's own length. The per-sequence length division lets long wrong answers go unpunished.
The paper's runs use beta = 0 and the symmetric clip of 0.2.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torch import Tensor

from gpo import ops
from gpo.algorithms.base import BaseObjective, ObjectiveConfig, PPOClip
from gpo.errors import UserError
from gpo.registry import register
from gpo.schema import NonNegative, PositiveInt


@dataclass(frozen=True)
class DrGRPOConfig(ObjectiveConfig, PPOClip):
    beta: NonNegative = 0.0  # no KL term, so no reference model
    loss_normalizer: PositiveInt | None = None  # the constant token sums are divided by; null: max_completion_length


@register("algo", "dr_grpo", config=DrGRPOConfig)
class DrGRPO(BaseObjective):
    """Dr. GRPO: unscaled advantages r - mean, token sums over a constant (max completion length), beta 0."""

    def __init__(self, cfg: DrGRPOConfig, max_completion_length: int | None = None) -> None:
        super().__init__(cfg, max_completion_length)
        normaliser = cfg.loss_normalizer if cfg.loss_normalizer is not None else max_completion_length
        if normaliser is None:  # both are typed >= 1 where set; the engine always passes the length limit
            raise UserError(
                "dr_grpo divides token sums by a constant: set algo.loss_normalizer, or let the engine pass "
                "train.max_completion_length (both are null)."
            )
        self.normaliser = normaliser
        self.aggregate = partial(ops.token_sum_norm, normaliser=normaliser)

    def advantages(self, rewards: Tensor) -> Tensor:
        return ops.group_advantages(rewards, scale_by_std=False)  # [B, G]
