"""A test-only task whose groups are foreseeable: question i is always right (i % 3 == 0), always wrong
(i % 3 == 1) or right on completions of even length (i % 3 == 2, mixed groups), so selectors have something to
screen out and a tiny random model still gives some groups with signal. Also a test-only selector whose phases do
not depend on rewards at all (`first_of_round`), so a test can say exactly which calls a step makes."""

from __future__ import annotations

from dataclasses import dataclass

from gpo.registry import register
from gpo.selectors.none import NoSelection
from gpo.types import Grade, QuestionRewards, Rewards


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


@dataclass(frozen=True)
class FirstOfRoundConfig:
    n_screen: int = 2


@register("selector", "first_of_round", config=FirstOfRoundConfig)
class FirstOfRound(NoSelection):
    """Screens every candidate with n_screen completions and continues only the first of each round (test-only);
    it keeps no history (the rest is `none`'s)."""

    def first_phase(self, questions: list[int], group_size: int, seed: int) -> list[int]:
        return [self.cfg.n_screen] * len(questions)

    def continue_after(self, questions: list[int], rewards: list[QuestionRewards], group_size: int) -> list[bool]:
        return [i == 0 for i in range(len(questions))]
