"""A test-only task whose groups are foreseeable: question i is always right (i % 3 == 0), always wrong
(i % 3 == 1) or right on completions of even length (i % 3 == 2, mixed groups), so selectors have something to
screen out and a tiny random model still gives some groups with signal."""

from __future__ import annotations

from dataclasses import dataclass

from gpo.registry import register
from gpo.types import Grade, Rewards


@dataclass
class ThirdsConfig:
    size: int = 12


def kind(index: int) -> str:
    return ("easy", "hard", "mixed")[index % 3]


@register("task", "thirds", config=ThirdsConfig)
class ThirdsTask:
    """Always right, always wrong, or right on even-length completions, by question index (test-only)."""

    def __init__(self, cfg: ThirdsConfig) -> None:
        self.cfg = cfg

    def load(self, split: str) -> list[dict]:
        return [{"question": f"Say something about {i}.", "index": i, "kind": kind(i)} for i in range(self.cfg.size)]

    def prompt(self, example: dict) -> list[dict]:
        return [{"role": "user", "content": example["question"]}]

    def reward(self, completions: list[str], examples: list[dict]) -> Rewards:
        scores = [1.0 if e["kind"] == "easy" else 0.0 if e["kind"] == "hard" else float(len(c) % 2 == 0)
                  for c, e in zip(completions, examples, strict=True)]
        return Rewards(total=scores, components={"accuracy": scores})

    def grade(self, completions: list[str], examples: list[dict]) -> list[Grade]:
        return [Grade(extracted=c, gold="", correct=s > 0, formatted=True)
                for c, s in zip(completions, self.reward(completions, examples).total, strict=True)]

    def close(self) -> None:
        pass  # holds nothing outside Python
