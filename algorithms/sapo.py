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

import torch
from torch import Tensor

from gpo import ops
from gpo.errors import UserError
from gpo.registry import register
from gpo.types import RolloutBatch, StepTotals


@dataclass
class SAPOConfig:
    tau_pos: float = 1.0  # gate temperature for tokens with A > 0
    tau_neg: float = 1.05  # and for tokens with A <= 0 (larger: their updates fade faster)
    beta: float = 0.0  # KL coefficient; 0 loads no reference model
    kl_estimator: str = "k3"  # used only when beta > 0
    kl_clamp: float | None = None
    is_correction: str = "token"  # token | sequence | none: weigh losses by min(pi_old / pi_sampler, is_cap)
    is_cap: float = 2.0  # truncation of those weights; they apply only with a backend that reports log-probs (vllm)
    std_eps: float = 1e-4  # advantage = (r - mean) / (std + std_eps), TRL's value


@register("algo", "sapo", config=SAPOConfig)
class SAPO:
    """SAPO (arXiv 2511.20347): the soft gate (4/tau) sigmoid(tau (ratio - 1)) for the clip; tau 1.0 / 1.05."""

    def __init__(self, cfg: SAPOConfig, mu: int = 1, max_completion_length: int | None = None) -> None:
        if mu < 1:
            raise UserError(f"train.mu (policy updates per generation) must be >= 1, got {mu}.")
        for key in ("tau_pos", "tau_neg"):
            if not getattr(cfg, key) > 0:
                raise UserError(f"algo.{key} (a gate temperature) must be > 0, got {getattr(cfg, key)}.")
        self.cfg = cfg
        self.policy_loss = ops.PolicyLoss.with_surrogate(self.surrogate, cfg)
        self.needs_ref_logprobs = cfg.beta > 0
        self.needs_old_logprobs = mu > 1

    def surrogate(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> ops.Surrogate:
        return ops.soft_gate_surrogate(logp, old_logp, advantages, tau_pos=self.cfg.tau_pos, tau_neg=self.cfg.tau_neg)

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
        return rewards

    def group_filter(self, rewards: Tensor, components: dict[str, Tensor]) -> Tensor:
        return torch.ones(rewards.shape[0], dtype=torch.bool)  # [B]

    def advantages(self, rewards: Tensor) -> Tensor:
        return ops.group_advantages(rewards, scale_by_std=True, eps=self.cfg.std_eps)  # [B, G]

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        return batch.completion_mask

    def loss(self, logp: Tensor, batch: RolloutBatch, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        return self.policy_loss(logp, batch, self.loss_mask(batch), totals, ops.seq_mean)
