"""`threshold`: the CPPO paper's threshold rule (arXiv 2503.22342, the predefined threshold gamma).

Relative to GRPO: completions whose |advantage| is below gamma get no forward pass at all; advantages of the kept
rows are unchanged. The paper's released code only has top-k; this is the rule as the paper states it. The kept
count varies from step to step, so the allocator cannot know it up front (it refills instead), and the optional
`min_keep_per_group` floor keeps each question's largest-|A| rows so no group vanishes entirely. On several ranks
the kept count is topped up to a multiple of the world size with the largest |A| below gamma.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gpo.errors import UserError
from gpo.ops import group_index
from gpo.pruners.ranking import Seed, advantage_magnitude, keep_top, row_keys, top_up
from gpo.registry import register
from gpo.run_config import RunConfig
from gpo.schema import NonNegative, NonNegativeInt
from gpo.types import RolloutBatch


@dataclass(frozen=True)
class ThresholdConfig:
    gamma: NonNegative = 0.5  # drop completions with |A| < gamma
    min_keep_per_group: NonNegativeInt = 0  # floor: keep at least this many largest-|A| rows of every group
    seed: Seed = 0  # tie-break key for the floor among equal |A|

    def check_run(self, run: RunConfig) -> None:
        G = run.train.group_size
        if self.min_keep_per_group > G:
            raise UserError(f"pruner.min_keep_per_group={self.min_keep_per_group} is more than train.group_size={G}: "
                            f"a group cannot keep more rows than it has (use at most {G}).")


@register("pruner", "threshold", config=ThresholdConfig)
class ThresholdPruner:
    """Drop completions with |advantage| below gamma, keeping an optional floor per group."""

    def __init__(self, cfg: ThresholdConfig) -> None:
        self.cfg = cfg

    def keep(self, batch: RolloutBatch, multiple_of: int = 1) -> Tensor:
        """|A| >= gamma, plus the floor; a top-up to a multiple of `multiple_of` takes the largest |A| left."""
        score = advantage_magnitude(batch)  # [N]
        return top_up(self._rule(batch, score), score, multiple_of)

    def _rule(self, batch: RolloutBatch, score: Tensor) -> Tensor:
        above = score >= self.cfg.gamma  # [N]
        if self.cfg.min_keep_per_group == 0:
            return above
        group, sizes = group_index(batch)
        if len(sizes) and int(sizes.min()) < self.cfg.min_keep_per_group:
            raise UserError(
                f"pruner.min_keep_per_group={self.cfg.min_keep_per_group} exceeds the group size "
                f"{int(sizes.min())}; lower it."
            )
        floor = torch.full_like(sizes, self.cfg.min_keep_per_group)  # [groups]
        return above | keep_top(score, row_keys(batch, self.cfg.seed), group, floor)

    def expected_kept_per_group(self, group_size: int) -> float | None:
        # Depends on the rewards of each step; gamma=0 keeps everything.
        return float(group_size) if self.cfg.gamma == 0 else None
