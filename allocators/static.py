"""`static`: B questions x G completions per step, the plain GRPO layout. No refill rounds by default."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpo.errors import UserError
from gpo.registry import register


@dataclass
class StaticConfig:
    max_rounds: int = 1  # > 1 lets group filtering (DAPO dynamic sampling) refill emptied slots


@register("allocator", "static", config=StaticConfig)
class StaticAllocator:
    """Draw B = slots / G questions per step; optionally refill slots that group filtering emptied."""

    def __init__(self, cfg: StaticConfig) -> None:
        if cfg.max_rounds < 1:
            raise UserError(f"allocator.max_rounds must be >= 1, got {cfg.max_rounds}.")
        self.cfg = cfg
        self._rounds = 0

    def first_round(self, slots: int, group_size: int, kept_per_group: float | None, world_size: int) -> int:
        questions = slots // group_size
        if questions * group_size != slots or questions % world_size:
            raise UserError(
                f"static allocator: {slots} slots are not a whole number of groups of {group_size} "
                f"split evenly over {world_size} rank(s)."
            )
        self._rounds = 1
        return questions

    def next_round(self, slots_left: int, rounds_done: int, group_size: int, kept_per_group: float | None,
                   world_size: int) -> int:
        if rounds_done >= self.cfg.max_rounds or slots_left <= 0:
            return 0
        self._rounds = rounds_done + 1
        questions = math.ceil(slots_left / group_size)
        return math.ceil(questions / world_size) * world_size

    def metrics(self) -> dict[str, float]:
        return {"alloc/rounds": float(self._rounds)}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
