"""`topk`: CPPO's completion pruning (Lin et al., "CPPO: Accelerating the Training of Group Relative Policy
Optimization-Based Reasoning Models", arXiv 2503.22342).

Relative to GRPO: after advantages are known, only the k completions with the largest |A| go on to the old-policy,
reference and policy passes; the rest are dropped before any forward pass. Advantages are not changed: kept rows
keep the A computed over the full group.

What differs from the CPPO paper's code (arXiv 2503.22342): k is an integer validated up front (no `int(G*(1-P))`
truncation); the unit it counts over is an explicit `scope` decided on the gathered batch, so `group` and `global`
do not depend on the number of ranks; ties break by a seeded per-row key, never by `torch.topk`'s order.
Its counts and everything but the score are `random`'s too (`QuotaPruner` in gpo.pruners.ranking).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from gpo.pruners.ranking import QuotaConfig, QuotaPruner, advantage_magnitude
from gpo.registry import register
from gpo.types import RolloutBatch


@dataclass(frozen=True)
class TopKConfig(QuotaConfig):
    """k = G - round(G*P) kept per group (or `keep`), over `scope`; `seed` breaks ties between equal |A|."""


@register("pruner", "topk", config=TopKConfig)
class TopKPruner(QuotaPruner):
    """Keep the k completions with the largest |advantage| per group, rank or step (CPPO)."""

    def ranking(self, batch: RolloutBatch, key: Tensor) -> tuple[Tensor, Tensor]:
        """The k largest |A| per scope unit; a top-up to a multiple of the world size takes the largest |A| left."""
        score = advantage_magnitude(batch)  # [N]
        return score, score
