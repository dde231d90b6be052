"""`topk`: CPPO's completion pruning (Lin et al., "CPPO: Accelerating the Training of Group Relative Policy
Optimization-Based Reasoning Models", arXiv 2503.22342).

Relative to GRPO: after advantages are known, only the k completions with the largest |A| go on to the old-policy,
reference and policy passes; the rest are dropped before any forward pass. Advantages are not changed: kept rows
keep the A computed over the full group.

What differs from the paper's code (reference section 8): k is an integer validated up front (no `int(G*(1-P))`
truncation); the unit it counts over is an explicit `scope` decided on the gathered batch, so `group` and `global`
do not depend on the number of ranks; ties break by a seeded per-row key, never by `torch.topk`'s order.
The selection primitives are shared with `random` and `threshold` (gpo.pruners.ranking).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from gpo.pruners.ranking import Quota, Scope, Seed, keep_top, row_keys, top_up
from gpo.registry import register
from gpo.schema import PositiveInt, Rate
from gpo.types import RolloutBatch


@dataclass(frozen=True)
class TopKConfig:
    rate: Rate | None = 0.75  # P, the fraction pruned per group: k = G - round(G*P) kept
    keep: PositiveInt | None = None  # k kept per group; when set it replaces `rate`
    scope: Scope = "group"  # group | rank | global, see gpo.pruners.ranking.Scope
    seed: Seed = 0  # tie-break key; combined with each row's tokens so it changes from step to step


@register("pruner", "topk", config=TopKConfig)
class TopKPruner:
    """Keep the k completions with the largest |advantage| per group, rank or step (CPPO)."""

    def __init__(self, cfg: TopKConfig) -> None:
        self.cfg = cfg
        self.quota = Quota(cfg.rate, cfg.keep, cfg.scope)

    def keep(self, batch: RolloutBatch, multiple_of: int = 1) -> Tensor:
        """The k largest |A| per scope unit; a top-up to a multiple of `multiple_of` takes the largest |A| left."""
        score = batch.advantages.abs().float().cpu()  # [N]
        segment, quota = self.quota.segments(batch)
        return top_up(keep_top(score, row_keys(batch, self.cfg.seed), segment, quota), score, multiple_of)

    def expected_kept_per_group(self, group_size: int) -> float:
        return float(self.quota.per_group(group_size))
