"""`none`: every candidate question gets its whole group of G completions (plain GRPO; the default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from gpo.registry import register


@dataclass(frozen=True)
class NoneConfig:
    pass


@register("selector", "none", config=NoneConfig)
class NoSelection:
    """Generate G completions for every question drawn (no selection before generation)."""

    def __init__(self, cfg: NoneConfig) -> None:
        self.cfg = cfg

    def first_phase(self, questions: list[int], group_size: int, seed: int) -> list[int]:
        return [group_size] * len(questions)

    def continue_after(self, questions: list[int], rewards: list[Tensor], group_size: int) -> list[bool]:
        return [True] * len(questions)  # never asked: every group is whole after the first phase

    def observe(self, questions: list[int], rewards: list[Tensor], step: int) -> None:
        pass

    def expected_pass_fraction(self) -> float | None:
        return 1.0

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
