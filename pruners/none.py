"""`none`: keep every completion (plain GRPO/DAPO/Dr.GRPO, the baseline CPPO is measured against)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gpo.registry import register
from gpo.types import RolloutBatch


@dataclass(frozen=True)
class NoneConfig:
    pass


@register("pruner", "none", config=NoneConfig)
class KeepAll:
    """Keep every completion: no pruning."""

    def __init__(self, cfg: NoneConfig) -> None:
        self.cfg = cfg

    def keep(self, batch: RolloutBatch, multiple_of: int = 1) -> Tensor:
        """Every row. Nothing is left out, so nothing can be added: N rows split evenly only if N does."""
        return torch.ones(len(batch), dtype=torch.bool)  # [N]

    def expected_kept_per_group(self, group_size: int) -> float:
        return float(group_size)
