"""`screen`: SPEED-RL's screening phase (Zhang, Arora, Mei, Zanette, arXiv 2506.09016; Zanette-Labs/speed-rl).

Relative to GRPO: each candidate question first gets `n_screen` completions (paper: 4); only those whose screening
rewards are not all equal (neither all right nor all wrong: SPEED-RL keeps prompts with a pass rate strictly
between 0 and 1) get the remaining G - n_screen, so a question that would have been a zero-advantage group costs
n_screen rollouts instead of G. The screening completions are part of the group; none is thrown away.

Where gpo differs, and why:
- SPEED-RL fills its batch from a buffer of qualified prompts carried across steps; gpo fills it through the
  allocator (ceil(B*G / (k * pass estimate)) candidates and bounded refill rounds), so a step's questions and
  its rollouts stay in that step and the checkpoint needs no buffer of half-used prompts.
- The paper's rule is on binary pass rates; for graded rewards "not all equal" means a spread above
  `tolerance` (gpo.selectors.variance), the same definition every selector uses.
- Within a step, the continuation of one round and the screening of the next refill round share one generation
  call (backends with a count per prompt: hf's own decoder, vllm; others share it only when G - n_screen equals
  n_screen). The size of that refill is decided before the continuation is generated, from the pruner's estimate
  of what the continued groups keep. SPEED-RL also overlaps steps; gpo keeps each step's rollouts in that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from torch import Tensor

from gpo.registry import register
from gpo.schema import Ge, NonNegative
from gpo.selectors.variance import PASS_ESTIMATE_FLOOR, no_variance


@dataclass(frozen=True)
class ScreenConfig:
    # completions per question in the screening phase (SPEED-RL: N_init = 4); one completion has no variance
    n_screen: Annotated[int, Ge(2)] = 4
    tolerance: NonNegative = 1e-6  # rewards within this spread count as equal (exact for binary rewards)


@register("selector", "screen", config=ScreenConfig)
class Screen:
    """SPEED-RL: n_screen completions first; only questions with unequal screening rewards continue to G."""

    def __init__(self, cfg: ScreenConfig) -> None:
        self.cfg = cfg
        self.screened = 0  # over the run: questions screened, and those that went on to G
        self.passed = 0
        self._step = {"screened": 0, "passed": 0}

    def first_phase(self, questions: list[int], group_size: int, seed: int) -> list[int]:
        if self.cfg.n_screen >= group_size:  # nothing to save: a screen of G is the whole group
            return [group_size] * len(questions)
        return [self.cfg.n_screen] * len(questions)

    def continue_after(self, questions: list[int], rewards: list[Tensor], group_size: int) -> list[bool]:
        verdicts = [not no_variance(r, self.cfg.tolerance) for r in rewards]
        self._step["screened"] += len(verdicts)
        self._step["passed"] += sum(verdicts)
        return verdicts

    def observe(self, questions: list[int], rewards: list[Tensor], step: int) -> None:
        self.screened += self._step["screened"]
        self.passed += self._step["passed"]
        self._step = {"screened": 0, "passed": 0}

    def expected_pass_fraction(self) -> float | None:
        if self.screened == 0:
            return None
        return max(self.passed / self.screened, PASS_ESTIMATE_FLOOR)

    def metrics(self) -> dict[str, float]:
        estimate = self.expected_pass_fraction()
        return {} if estimate is None else {"select/pass_estimate": estimate}

    def state_dict(self) -> dict[str, Any]:
        return {"screened": self.screened, "passed": self.passed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.screened, self.passed = int(state["screened"]), int(state["passed"])
        self._step = {"screened": 0, "passed": 0}
