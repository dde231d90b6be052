"""`static`: B questions x G completions per step, the plain GRPO layout. No refill rounds by default."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpo.errors import UserError
from gpo.registry import register
from gpo.schema import PositiveInt


@dataclass(frozen=True)
class StaticConfig:
    max_rounds: PositiveInt = 1  # > 1 lets group filtering (DAPO dynamic sampling) refill emptied slots


def check_layout(slots: int, group_size: int, world_size: int) -> None:
    """Checks of the step's layout every allocator needs before its first step (its own fields are typed)."""
    if slots < 1 or group_size < 1 or world_size < 1:
        raise UserError(f"allocator: slots ({slots}), group size ({group_size}) and world size ({world_size}) "
                        "must all be >= 1.")
    if slots % world_size:
        raise UserError(
            f"allocator: {slots} training rows per step (train.questions_per_step x train.group_size) do not split "
            f"evenly over {world_size} ranks; make questions_per_step x group_size a multiple of {world_size}."
        )


def whole_ranks(questions: int, world_size: int) -> int:
    """Round a question count up to a multiple of the world size, so every rank generates the same share."""
    return math.ceil(questions / world_size) * world_size


class StepLedger:
    """One step's allocation so far: rounds, questions drawn, and how full the slots ended up.

    The engine calls `next_round(slots_left, ...)` after every round, including the last, so the allocator sees
    the final fill itself and no one has to report it separately. While a round still generates its second phase
    slots_left is an estimate, and the engine asks again once that round's rows are known.
    """

    def __init__(self) -> None:
        self.slots = self.rounds = self.questions = 0
        self.slots_left = 0

    def start(self, slots: int, questions: int) -> int:
        self.slots, self.rounds, self.questions, self.slots_left = slots, 1, questions, slots
        return questions

    def add(self, slots_left: int, questions: int) -> int:
        self.slots_left = slots_left
        if questions:
            self.rounds += 1
            self.questions += questions
        return questions

    @property
    def filled(self) -> int:
        return self.slots - max(self.slots_left, 0)

    def metrics(self) -> dict[str, float]:
        return {
            "alloc/rounds": float(self.rounds),
            "alloc/questions": float(self.questions),
            "alloc/slots_filled_frac": self.filled / self.slots if self.slots else 0.0,
        }


@register("allocator", "static", config=StaticConfig)
class StaticAllocator:
    """Draw B = slots / G questions per step; optionally refill slots that group filtering emptied."""

    def __init__(self, cfg: StaticConfig) -> None:
        self.cfg = cfg
        self.step = StepLedger()

    def first_round(self, slots: int, group_size: int, kept_per_group: float | None, world_size: int,
                    pass_rate: float = 1.0) -> int:
        check_layout(slots, group_size, world_size)
        questions = slots // group_size
        if questions * group_size != slots or questions % world_size:
            raise UserError(
                f"static allocator: {slots} slots are not a whole number of groups of {group_size} "
                f"split evenly over {world_size} rank(s)."
            )
        return self.step.start(slots, questions)

    def next_round(self, slots_left: int, rounds_done: int, group_size: int, kept_per_group: float | None,
                   world_size: int, pass_rate: float = 1.0) -> int:
        more = rounds_done < self.cfg.max_rounds and slots_left > 0
        return self.step.add(slots_left, whole_ranks(math.ceil(slots_left / group_size), world_size) if more else 0)

    def metrics(self) -> dict[str, float]:
        return self.step.metrics()

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing carries over from one step to the next

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
