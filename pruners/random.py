"""`random`: the CPPO paper's random-pruning ablation (arXiv 2503.22342).

Relative to GRPO: like `topk` it keeps k completions per group, rank or step before any forward pass, but chooses
them uniformly at random instead of by |advantage|, which isolates the value of the |A| ranking. The choice comes
from the same seeded per-row key as topk's tie-break (the paper's code used the per-device global RNG, so ranks
drew differently), so it is reproducible and identical on every rank. Rows added to make the kept count a multiple
of the world size are drawn by the same key, so |A| plays no part anywhere in this pruner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gpo.pruners.ranking import QuotaConfig, QuotaPruner
from gpo.registry import register
from gpo.types import RolloutBatch


@dataclass(frozen=True)
class RandomConfig(QuotaConfig):
    """topk's counts (k = G - round(G*P) per group, or `keep`, over `scope`), the k rows chosen at random: `seed`
    is the draw."""


@register("pruner", "random", config=RandomConfig)
class RandomPruner(QuotaPruner):
    """Keep k completions chosen uniformly at random per group, rank or step (CPPO ablation)."""

    def ranking(self, batch: RolloutBatch, key: Tensor) -> tuple[Tensor, Tensor]:
        """Every row ties, so the smallest keys are kept; a top-up takes the smallest keys left, whatever their |A|."""
        return torch.zeros(len(batch)), -key  # [N], [N]
