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

from torch import Tensor

from gpo import ops
from gpo.algorithms.base import BaseObjective, ObjectiveConfig, PPOClip
from gpo.registry import register
from gpo.schema import NonNegative, Positive


@dataclass(frozen=True)
class ReinforcePPConfig(ObjectiveConfig, PPOClip):
    beta: NonNegative = 0.0  # KL coefficient; 0 loads no reference model
    kl_estimator: ops.KLEstimator = "k2"  # the paper's estimator for the KL loss term (used only when beta > 0)
    whiten_eps: Positive = 1e-8  # A / sqrt(var + whiten_eps), verl's masked_whiten value


@register("algo", "reinforce_pp", config=ReinforcePPConfig)
class ReinforcePP(BaseObjective):
    """REINFORCE++-baseline (arXiv 2501.03262): r - group mean, whitened over the whole batch; token-mean PPO clip."""

    aggregate = staticmethod(ops.token_mean)

    def advantages(self, rewards: Tensor) -> Tensor:
        centred = ops.group_advantages(rewards, scale_by_std=False)  # [B, G]
        return ops.batch_whiten(centred, eps=self.cfg.whiten_eps)  # [B, G]
