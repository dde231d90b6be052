"""A test-only task, registered as a plug-in: rewards completions by their length, so even a random tiny model
gets groups with different rewards (non-zero advantages) and every pruner has something to choose from."""

from __future__ import annotations

from dataclasses import dataclass

from gpo.errors import UserError
from gpo.registry import register
from gpo.types import Grade, Rewards


@dataclass
class ToyConfig:
    size: int = 64


@register("task", "toy", config=ToyConfig)
class ToyTask:
    """Reward = completion length / 100 (test-only)."""

    def __init__(self, cfg: ToyConfig) -> None:
        self.cfg = cfg

    def load(self, split: str) -> list[dict]:
        offset = {"train": 0, "validation": 1000, "test": 2000}[split]
        return [{"question": f"Count to {i + offset}.", "answer": str(i + offset)} for i in range(self.cfg.size)]

    def prompt(self, example: dict) -> list[dict]:
        return [{"role": "user", "content": example["question"]}]

    def reward(self, completions: list[str], examples: list[dict]) -> Rewards:
        lengths = [len(c) / 100 for c in completions]
        # Its pass criterion (`accuracy`, what DAPO's dynamic sampling and the selectors judge by) is a coin flip
        # per completion: an even length passes. A group of 4 is then mixed 7 times in 8, as real tasks' groups are
        # for a model at mid accuracy; the length itself would pass every non-empty completion.
        return Rewards(total=lengths, components={"accuracy": [float(len(c) % 2 == 0) for c in completions]})

    def grade(self, completions: list[str], examples: list[dict]) -> list[Grade]:
        return [Grade(extracted=c[-3:], gold=e["answer"], correct=c.strip().endswith(e["answer"]), formatted=True)
                for c, e in zip(completions, examples)]

    def close(self) -> None:
        pass  # holds nothing outside Python


@dataclass(frozen=True)
class RefusingConfig:
    rate: float = 0.5  # takes the grid's pruner.rate like topk does


@register("pruner", "refusing", config=RefusingConfig)
class RefusingPruner:
    """Refuses to be built: a run of a study that fails after composing, when its parts are built (test-only)."""

    def __init__(self, cfg: RefusingConfig) -> None:
        raise UserError("the refusing pruner refuses to be built (test-only)")
