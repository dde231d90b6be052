"""`random`: the CPPO paper's random-pruning ablation (arXiv 2503.22342).

Relative to GRPO: like `topk` it keeps k completions per group, rank or step before any forward pass, but chooses
them uniformly at random instead of by |advantage|, which isolates the value of the |A| ranking. The choice comes
from the same seeded per-row key as topk's tie-break (the paper's code used the per-device global RNG, so ranks
drew differently), so it is reproducible and identical on every rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpo.pruners.topk import Quota, TopKConfig, keep_top, row_keys
from gpo.registry import register
from gpo.types import RolloutBatch


@register("pruner", "random", config=TopKConfig)
class RandomPruner:
    """Keep k completions chosen uniformly at random per group, rank or step (CPPO ablation)."""

    def __init__(self, cfg: TopKConfig) -> None:
        self.cfg = cfg
        self.quota = Quota(cfg.rate, cfg.keep, cfg.scope)

    def keep(self, batch: RolloutBatch) -> Tensor:
        segment, quota = self.quota.segments(batch)
        no_preference = torch.zeros(len(batch))  # [N]: every row ties, so the random key alone decides
        return keep_top(no_preference, row_keys(batch, self.cfg.seed), segment, quota)

    def expected_kept_per_group(self, group_size: int) -> float:
        return float(self.quota.per_group(group_size))
