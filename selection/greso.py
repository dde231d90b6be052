"""`greso`: GRESO's pre-rollout skipping (Zheng et al., arXiv 2506.02177; Infini-AI-Lab/GRESO).

Relative to GRPO: a question whose groups had zero variance the last z times it was drawn (a streak over past
epochs of a finite pool) is skipped with probability 1 - max(p^z, p_min), so questions that keep giving all-right
(easy: success rate 1) or all-wrong (hard: success rate 0) groups stop costing rollouts, while every one keeps a
chance to come back. Right and wrong are the task's pass criterion (`judge_on=accuracy`, selection/base.py), so eight
well-formatted wrong answers are a hard group, never an easy one.
Easy and hard streaks have their own base probability p_easy / p_hard, adapted after every round: when the
zero-variance share of that kind among the groups just generated is at or above its target, p drops by `adjust_step`
(skip more), otherwise it rises, within [p_low, p_high]. Paper settings: p starts at 0.5, steps of 0.01 within
[0.05, 0.95], a total target zero-variance share of 0.25.

The released code (Infini-AI-Lab/GRESO, verl/trainer/ppo/ray_trainer.py) splits the 0.25 target into 1/3 for easy
and 2/3 for hard groups ("more exploration on hard examples"), and moves p down when a kind's share is at or above
its target; gpo does the same (`easy_share` = 1/3, `>=`), comparing exact fractions: in floating point
0.25 * (1 - 1/3) is just above 1/6, so a hard share of exactly 1/6 would move p_hard the wrong way.

Where gpo differs, and why:
- The released code adapts p only from the second epoch on, over the groups of a whole (accumulated) step; gpo
  adapts after every round from the first, because a selector does not see epochs and a round is the unit in
  which it observes outcomes. Its skip rule itself lives in a file (presampling_selector.py) that could not be
  read for this port; the rule here is the paper's, max(p^z, p_min).
- `p_min` (default 0.01) floors the chance to draw a question again at any streak, so no question is dropped
  for good on a finite pool; the paper's p^z alone tends to 0.
- Decisions are drawn from a generator seeded by (run seed, step, round), not a global RNG, so every rank and
  every resumed run skips the same questions.
- The allocator, not an accumulated sampling batch, makes up for what is skipped (`expected_pass_rate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction as Exact
from typing import Any

import torch

from gpo.errors import UserError
from gpo.registry import register
from gpo.schema import Fraction, NonNegative
from gpo.selectors.base import PASS_RATE_FLOOR, JudgingSelector, PositiveFraction, SelectorConfig
from gpo.types import QuestionRewards

KIND = {"all_pass": "easy", "all_fail": "hard"}  # GRESO's names for the two zero-variance outcomes


@dataclass(frozen=True)
class GresoConfig(SelectorConfig):
    p_start: PositiveFraction = 0.5  # initial p_easy and p_hard (paper)
    adjust_step: NonNegative = 0.01  # paper
    p_low: PositiveFraction = 0.05  # paper: p stays within [0.05, 0.95]
    p_high: PositiveFraction = 0.95
    target: Fraction = 0.25  # target zero-variance share among generated groups (paper)
    # part of `target` allotted to easy (all-right) groups, the rest to hard (released code)
    easy_share: Fraction = 1 / 3
    p_min: Fraction = 0.01  # floor of the probability to draw a question at any streak (gpo)


def exact(value: float) -> Exact:
    """A config share as the fraction it stands for (1/3 is written 0.333...): the nearest with a denominator up to
    10^6, so a count that meets its target exactly compares equal to it."""
    return Exact(value).limit_denominator(10**6)


@register("selector", "greso", config=GresoConfig)
class Greso(JudgingSelector):
    """GRESO: skip questions with a streak of zero-variance groups, with probability 1 - max(p^z, p_min)."""

    cfg: GresoConfig

    def __init__(self, cfg: GresoConfig) -> None:
        if not cfg.p_low <= cfg.p_start <= cfg.p_high:  # each in (0, 1] by its type; their order is checked here
            raise UserError(f"selector: need p_low <= p_start <= p_high, got {cfg.p_low}, {cfg.p_start}, "
                            f"{cfg.p_high}.")
        super().__init__(cfg)
        self.p = {"easy": cfg.p_start, "hard": cfg.p_start}
        self.streaks: dict[int, tuple[str, int]] = {}  # question -> (kind of its streak, length z)
        self.drawn_frac: float | None = None  # share of the last round's candidates that were generated
        target, easy = exact(cfg.target), exact(cfg.easy_share)
        self.targets = {"easy": target * easy, "hard": target * (1 - easy)}

    def draw_probability(self, question: int) -> float:
        """max(p_kind^z, p_min) for the question's streak; 1 for a question without one."""
        kind, z = self.streaks.get(question, ("hard", 0))
        return 1.0 if z == 0 else max(self.p[kind] ** z, self.cfg.p_min)

    def first_phase(self, questions: list[int], group_size: int, seed: int) -> list[int]:
        draws = torch.rand(len(questions), generator=torch.Generator().manual_seed(seed)).tolist()
        counts = [group_size if u < self.draw_probability(q) else 0 for q, u in zip(questions, draws, strict=True)]
        if questions:
            self.drawn_frac = (len(questions) - counts.count(0)) / len(questions)
        return counts

    def observe(self, questions: list[int], rewards: list[QuestionRewards], step: int) -> None:
        C = self.cfg
        seen = {"easy": 0, "hard": 0}
        generated = [(q, r) for q, r in zip(questions, rewards, strict=True) if len(r)]  # skipped: empty records
        for q, r in generated:
            outcome = self.outcome(r)
            if outcome is None:
                self.streaks.pop(q, None)
                continue
            kind = KIND[outcome]
            previous, z = self.streaks.get(q, (kind, 0))
            self.streaks[q] = (kind, z + 1 if previous == kind else 1)
            seen[kind] += 1
        if not generated:
            return
        for kind, count in seen.items():
            move = -C.adjust_step if Exact(count, len(generated)) >= self.targets[kind] else C.adjust_step
            self.p[kind] = min(max(self.p[kind] + move, C.p_low), C.p_high)

    def expected_pass_rate(self) -> float | None:
        return None if self.drawn_frac is None else max(self.drawn_frac, PASS_RATE_FLOOR)

    def metrics(self) -> dict[str, float]:
        return {"select/p_easy": self.p["easy"], "select/p_hard": self.p["hard"],
                "select/streaks": float(sum(1 for _, z in self.streaks.values() if z > 0))}

    def state_dict(self) -> dict[str, Any]:
        return {"p": dict(self.p), "streaks": {int(q): [k, z] for q, (k, z) in self.streaks.items()},
                "drawn_frac": self.drawn_frac}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.p = {k: float(v) for k, v in state["p"].items()}
        self.streaks = {int(q): (str(k), int(z)) for q, (k, z) in state["streaks"].items()}
        self.drawn_frac = state["drawn_frac"]
