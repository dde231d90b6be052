"""`reinforce_pp`: REINFORCE++-baseline (Hu et al., "REINFORCE++", arXiv 2501.03262).

What changes relative to GRPO: the advantage's normalisation is global, not per group.
- A = r - group mean (the baseline), then whitened over the whole batch: (A - mean) / sqrt(var + 1e-8). GRPO divides
  by each group's own std, which correlates with its rewards and biases the estimate; one batch-wide std does not
  (the bias vanishes as the batch grows), and it still evens out the scale of rewards between steps.
- "Whole batch" here is what `Engine._rollout` hands `advantages`: every question of one sampling round of the
  step, gathered from all ranks (identical on every rank), before DAPO-style filtering and before pruning, so
  the kept rows keep the advantage of the full batch. A step that refills draws further rounds; each round is
  whitened on its own.
- a token-mean loss over the step's global token count (OpenRLHF's default aggregation, the paper's code).
Differences from peers: verl's `reinforce_plus_plus_baseline` whitens over tokens (each sequence weighted by its
length); gpo whitens over sequences, as the paper writes it (the objective sees rewards, not lengths). Groups whose
rewards are all equal keep exactly 0.
KL: the paper's baseline variant puts a KL term in the loss with the k2 estimator; the estimator defaults to k2 here,
but beta defaults to 0 (no reference model), as the other objectives of this family do; set `beta` to enable it.
Unchanged: PPO's clipped ratio per token, eps 0.2.
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
class ReinforcePPConfig:
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0  # KL coefficient; 0 loads no reference model
    kl_estimator: str = "k2"  # the paper's estimator for the KL loss term (used only when beta > 0)
    kl_clamp: float | None = None
    dual_clip: float | None = None
    is_correction: str = "token"  # token | sequence | none: weigh losses by min(pi_old / pi_sampler, is_cap)
    is_cap: float = 2.0  # truncation of those weights; they apply only with a backend that reports log-probs (vllm)
    whiten_eps: float = 1e-8  # A / sqrt(var + whiten_eps), verl's masked_whiten value


@register("algo", "reinforce_pp", config=ReinforcePPConfig)
class ReinforcePP:
    """REINFORCE++-baseline (arXiv 2501.03262): r - group mean, whitened over the whole batch; token-mean PPO clip."""

    def __init__(self, cfg: ReinforcePPConfig, mu: int = 1, max_completion_length: int | None = None) -> None:
        if mu < 1:
            raise UserError(f"train.mu (policy updates per generation) must be >= 1, got {mu}.")
        if not cfg.whiten_eps > 0:
            raise UserError(f"algo.whiten_eps must be > 0, got {cfg.whiten_eps}.")
        self.cfg = cfg
        self.policy_loss = ops.PolicyLoss.from_config(cfg)
        self.needs_ref_logprobs = cfg.beta > 0
        self.needs_old_logprobs = mu > 1

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
        return rewards

    def group_filter(self, rewards: Tensor, components: dict[str, Tensor]) -> Tensor:
        return torch.ones(rewards.shape[0], dtype=torch.bool)  # [B]

    def advantages(self, rewards: Tensor) -> Tensor:
        centred = ops.group_advantages(rewards, scale_by_std=False)  # [B, G]
        return ops.batch_whiten(centred, eps=self.cfg.whiten_eps)  # [B, G]

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        return batch.completion_mask

    def loss(self, logp: Tensor, batch: RolloutBatch, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        return self.policy_loss(logp, batch, self.loss_mask(batch), totals, ops.token_mean)
