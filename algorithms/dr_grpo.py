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

import torch
from torch import Tensor

from gpo import ops
from gpo.errors import UserError
from gpo.registry import register
from gpo.types import RolloutBatch, StepTotals


@dataclass
class DrGRPOConfig:
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0  # no KL term, so no reference model
    kl_estimator: str = "k3"  # used only when beta > 0
    kl_clamp: float | None = None
    dual_clip: float | None = None
    is_correction: str = "token"  # token | sequence | none: weigh losses by min(pi_old / pi_sampler, is_cap)
    is_cap: float = 2.0  # truncation of those weights; they apply only with a backend that reports log-probs (vllm)
    loss_normalizer: int | None = None  # the constant token sums are divided by; null: max_completion_length


@register("algo", "dr_grpo", config=DrGRPOConfig)
class DrGRPO:
    """Dr. GRPO: unscaled advantages r - mean, token sums over a constant (max completion length), beta 0."""

    def __init__(self, cfg: DrGRPOConfig, mu: int = 1, max_completion_length: int | None = None) -> None:
        if mu < 1:
            raise UserError(f"train.mu (policy updates per generation) must be >= 1, got {mu}.")
        normaliser = cfg.loss_normalizer if cfg.loss_normalizer is not None else max_completion_length
        if normaliser is None or normaliser < 1:
            raise UserError(
                "dr_grpo divides token sums by a constant: set algo.loss_normalizer >= 1, or let the engine pass "
                f"train.max_completion_length (got loss_normalizer={cfg.loss_normalizer}, "
                f"max_completion_length={max_completion_length})."
            )
        self.cfg = cfg
        self.normaliser = normaliser
        self.policy_loss = ops.PolicyLoss.from_config(cfg)
        self.aggregate = partial(ops.token_sum_norm, normaliser=normaliser)
        self.needs_ref_logprobs = cfg.beta > 0
        self.needs_old_logprobs = mu > 1

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
        return rewards

    def group_filter(self, rewards: Tensor, components: dict[str, Tensor]) -> Tensor:
        return torch.ones(rewards.shape[0], dtype=torch.bool)  # [B]

    def advantages(self, rewards: Tensor) -> Tensor:
        return ops.group_advantages(rewards, scale_by_std=False)  # [B, G]

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        return batch.completion_mask

    def loss(self, logp: Tensor, batch: RolloutBatch, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        return self.policy_loss(logp, batch, self.loss_mask(batch), totals, self.aggregate)
