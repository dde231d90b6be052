"""What every selector shares, so each selector module is only its difference: the Selector interface's defaults
(gpo/types.py), how a question's completions are judged (`judge_on`), and the floor of the selection pass rate.

Judging. SPEED-RL, GRESO and MoPPS state their rules on a question's success rate, the share of its completions that
a verifier marks right; DAPO's group filter reads the same criterion (algo.filter_on, algorithms/dapo.py). With
`judge_on=accuracy` (the default) a completion passes by the task's pass criterion (`QuestionRewards.passed`: the
`accuracy` component unless the task names another), so a format bonus never makes a wrong answer count as right
(GSM8K and MATH weigh format 1.0: a well-formatted wrong answer totals 1.0); a task without that component is judged
on its total instead. With `judge_on=total` the total reward (the task's weighted sum of its components) is judged:
totals within `tolerance` are equal, and a completion passes at >= `success_threshold`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from torch import Tensor

from gpo.ops import no_variance
from gpo.schema import Gt, Le, NonNegative
from gpo.types import QuestionRewards

# (0, 1]: a share or probability that must leave something (GRESO's p, MoPPS's kept share and decay).
PositiveFraction = Annotated[float, Gt(0), Le(1)]

# A selector's expected pass rate never goes below this: a step then draws at most 8x the candidates it would draw
# without selection, so one unlucky stretch cannot make the dynamic allocator generate without bound.
PASS_RATE_FLOOR = 0.125

Outcome = Literal["all_pass", "all_fail"] | None  # a question's completions so far; None: mixed (has a signal)


@dataclass(frozen=True)
class SelectorConfig:
    """Settings every judging selector (screen, greso, mopps) shares."""

    judge_on: Literal["accuracy", "total"] = "accuracy"  # the task's pass criterion, or its total reward
    tolerance: NonNegative = 1e-6  # judge_on=total: totals within this spread count as equal
    success_threshold: float = 0.5  # judge_on=total: a completion whose total is >= this passes


class SelectorBase:
    """The Selector interface's defaults: every candidate gets its whole group at once, nothing is kept between
    rounds, and every candidate is expected to reach a whole group."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def first_phase(self, questions: list[int], group_size: int, seed: int) -> list[int]:
        return [group_size] * len(questions)

    def continue_after(self, questions: list[int], rewards: list[QuestionRewards], group_size: int) -> list[bool]:
        return [True] * len(questions)  # never asked unless first_phase screens: every group is whole at once

    def observe(self, questions: list[int], rewards: list[QuestionRewards], step: int) -> None:
        pass

    def expected_pass_rate(self) -> float | None:
        return 1.0

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class JudgingSelector(SelectorBase):
    """A selector that decides on its questions' outcomes: passes, and all-pass / all-fail / mixed."""

    cfg: SelectorConfig

    def criterion(self, r: QuestionRewards) -> Tensor | None:
        """The pass criterion [n] (0/1) when this selector judges on it, None when it judges the total."""
        return r.passed if self.cfg.judge_on == "accuracy" else None

    def passes(self, r: QuestionRewards) -> Tensor:
        """bool [n]: the completions that count as right."""
        passed = self.criterion(r)
        return r.total >= self.cfg.success_threshold if passed is None else passed.bool()

    def successes(self, r: QuestionRewards) -> int:
        return int(self.passes(r).sum())

    def outcome(self, r: QuestionRewards) -> Outcome:
        """all_pass (success rate 1), all_fail (success rate 0), or None for a mixed question. "No variance" is
        gpo.ops.no_variance of the judged values: exact on the 0/1 pass criterion, within `tolerance` on totals."""
        passed = self.criterion(r)
        flat = no_variance(r.total, self.cfg.tolerance) if passed is None else no_variance(passed, 0.0)
        if not flat:
            return None
        return "all_pass" if bool(self.passes(r).all()) else "all_fail"
