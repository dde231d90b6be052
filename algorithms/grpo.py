"""`grpo`: Group Relative Policy Optimization (Shao et al., DeepSeekMath, arXiv 2402.03300).

The reference point of the family. GRPO drops PPO's value model: each question gets G completions, and a
completion's advantage is its reward standardised within its group. The clipped PPO surrogate applies per token,
and a k3 KL penalty to a frozen reference model is added to the loss, not to the reward. The paper's loss averages
tokens within each sequence and then averages over sequences (`seq_mean`). The CPPO code and TRL's `bnpo`
average over tokens instead (`token_mean`).
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
class GRPOConfig:
    epsilon_low: float = 0.2  # ratio clipped below at 1 - epsilon_low
    epsilon_high: float = 0.2  # and above at 1 + epsilon_high (symmetric in the paper)
    beta: float = 0.04  # KL coefficient (paper: 0.04); 0 skips the reference model entirely
    kl_estimator: str = "k3"  # k1 | k2 | k3 (the paper's unbiased estimator)
    kl_clamp: float | None = None  # bound the per-token KL estimate (verl low_var_kl: 10)
    dual_clip: float | None = None  # cap negative-advantage token losses at -A*c (verl: 3); off in the paper
    is_correction: str = "token"  # token | sequence | none: weigh losses by min(pi_old / pi_sampler, is_cap)
    is_cap: float = 2.0  # truncation of those weights; they apply only with a backend that reports log-probs (vllm)
    std_eps: float = 1e-4  # advantage = (r - mean) / (std + std_eps), TRL's value
    loss_agg: str = "seq_mean"  # seq_mean (paper) | token_mean (CPPO code, TRL bnpo; global token count)


@register("algo", "grpo", config=GRPOConfig)
class GRPO:
    """GRPO (DeepSeekMath): std-scaled group advantages, clip 0.2, k3 KL with beta 0.04, sequence-mean loss."""

    def __init__(self, cfg: GRPOConfig, mu: int = 1, max_completion_length: int | None = None) -> None:
        if mu < 1:
            raise UserError(f"train.mu (policy updates per generation) must be >= 1, got {mu}.")
        if cfg.loss_agg not in ops.AGGREGATIONS:
            raise UserError(f"algo.loss_agg must be one of {', '.join(ops.AGGREGATIONS)}, got `{cfg.loss_agg}`.")
        self.cfg = cfg
        self.policy_loss = ops.PolicyLoss.from_config(cfg)
        self.aggregate = ops.AGGREGATIONS[cfg.loss_agg]
        self.needs_ref_logprobs = cfg.beta > 0
        self.needs_old_logprobs = mu > 1

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
        return rewards

    def group_filter(self, rewards: Tensor, components: dict[str, Tensor]) -> Tensor:
        return torch.ones(rewards.shape[0], dtype=torch.bool)  # [B]

    def advantages(self, rewards: Tensor) -> Tensor:
        return ops.group_advantages(rewards, scale_by_std=True, eps=self.cfg.std_eps)  # [B, G]

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        return batch.completion_mask

    def loss(self, logp: Tensor, batch: RolloutBatch, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        return self.policy_loss(logp, batch, self.loss_mask(batch), totals, self.aggregate)
