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

from gpo.pruners.ranking import Quota, Scope, Seed, keep_top, row_keys, top_up
from gpo.registry import register
from gpo.schema import PositiveInt, Rate
from gpo.types import RolloutBatch


@dataclass(frozen=True)
class RandomConfig:
    rate: Rate | None = 0.75  # P, as topk's: k = G - round(G*P) kept, chosen at random
    keep: PositiveInt | None = None  # k kept per group; when set it replaces `rate`
    scope: Scope = "group"  # group | rank | global, see gpo.pruners.ranking.Scope
    seed: Seed = 0  # the draw: combined with each row's tokens, so it changes from step to step


@register("pruner", "random", config=RandomConfig)
class RandomPruner:
    """Keep k completions chosen uniformly at random per group, rank or step (CPPO ablation)."""

    def __init__(self, cfg: RandomConfig) -> None:
        self.cfg = cfg
        self.quota = Quota(cfg.rate, cfg.keep, cfg.scope)

    def keep(self, batch: RolloutBatch, multiple_of: int = 1) -> Tensor:
        """k rows per scope unit by the smallest keys; a top-up to a multiple of `multiple_of` takes the smallest
        keys left, whatever their |A|."""
        key = row_keys(batch, self.cfg.seed)  # [N]
        no_preference = torch.zeros(len(batch))  # [N]: every row ties, so the random key alone decides
        segment, quota = self.quota.segments(batch)
        return top_up(keep_top(no_preference, key, segment, quota), -key, multiple_of)  # smaller key, higher priority

    def expected_kept_per_group(self, group_size: int) -> float:
        return float(self.quota.per_group(group_size))
