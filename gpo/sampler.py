"""The order in which training questions are drawn: a seeded permutation per epoch, resumable exactly.

A pool is finite (arith: task.train_size; GSM8K and MATH: their train files), so every question comes back once
per epoch, in a new seeded order; selectors that learn from a question's history see it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gpo.errors import UserError
from gpo.types import Example


class QuestionStream:
    """Draws questions without replacement; a new seeded permutation each epoch, and no question is ever dropped."""

    def __init__(self, examples: Sequence[Example], seed: int) -> None:
        if len(examples) == 0:
            raise UserError("the task's train split is empty.")
        self.examples = examples
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation()

    def take(self, n: int) -> list[Example]:
        return [self.examples[i] for i in self.take_indices(n)]

    def take_indices(self, n: int) -> list[int]:
        """The next n questions as indices into the pool: a question's identity across epochs, ranks and resumes
        (what history-based selectors key their per-question state on)."""
        out: list[int] = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation()
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.examples), generator=g).tolist()
