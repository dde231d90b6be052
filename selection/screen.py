"""`screen`: SPEED-RL's screening phase (Zhang, Arora, Mei, Zanette, arXiv 2506.09016; Zanette-Labs/speed-rl).

Relative to GRPO: each candidate question first gets `n_screen` completions (paper: 4); only those whose screening
success rate lies strictly between 0 and 1 (neither all right nor all wrong, SPEED-RL's rule) get the remaining
G - n_screen, so a question that would have been a zero-advantage group costs n_screen rollouts instead of G. The
screening completions are part of the group; none is thrown away. Right and wrong are the task's pass criterion
(`judge_on=accuracy`, selection/base.py): eight wrong answers screen out whatever their formatting.

Where gpo differs, and why:
- SPEED-RL fills its batch from a buffer of qualified prompts carried across steps; gpo fills it through the
  allocator (ceil(B*G / (k * the selector's pass rate)) candidates and bounded refill rounds), so a step's
  questions and its rollouts stay in that step and the checkpoint needs no buffer of half-used prompts.
- With `judge_on=total` (or a task without a pass criterion) the rule reads the total reward: "not all equal"
  is then a spread above `tolerance` (gpo.ops.no_variance, the definition every selector and metric uses).
- Within a step, the continuation of one round and the screening of the next refill round share one generation
  call (backends with a count per prompt: hf's own decoder, vllm; others share it only when G - n_screen equals
  n_screen). The size of that refill is decided before the continuation is generated, from the pruner's estimate
  of what the continued groups keep. SPEED-RL also overlaps steps; gpo keeps each step's rollouts in that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from gpo.errors import UserError
from gpo.registry import register
from gpo.run_config import RunConfig
from gpo.schema import Ge
from gpo.selectors.base import PASS_RATE_FLOOR, JudgingSelector, SelectorConfig
from gpo.types import QuestionRewards


@dataclass(frozen=True)
class ScreenConfig(SelectorConfig):
    # completions per question in the screening phase (SPEED-RL: N_init = 4); one completion has no variance
    n_screen: Annotated[int, Ge(2)] = 4

    def check_run(self, run: RunConfig) -> None:
        """The screen is part of the group: it must leave completions for the questions that continue."""
        G = run.train.group_size
        if self.n_screen >= G:
            raise UserError(f"selector.n_screen={self.n_screen} is not smaller than train.group_size={G}: screening "
                            f"draws n_screen of a group's G completions first, so it must be < {G} (lower "
                            f"selector.n_screen, raise train.group_size, or use selector=none).")


@register("selector", "screen", config=ScreenConfig)
class Screen(JudgingSelector):
    """SPEED-RL: n_screen completions first; only questions with a screening success rate in (0, 1) continue to G."""

    cfg: ScreenConfig

    def __init__(self, cfg: ScreenConfig) -> None:
        super().__init__(cfg)
        self.screened = 0  # over the run: questions screened, and those that went on to G
        self.continued = 0
        self._step = {"screened": 0, "continued": 0}

    def first_phase(self, questions: list[int], group_size: int, seed: int) -> list[int]:
        if self.cfg.n_screen >= group_size:  # nothing to save: a screen of G is the whole group
            return [group_size] * len(questions)
        return [self.cfg.n_screen] * len(questions)

    def continue_after(self, questions: list[int], rewards: list[QuestionRewards], group_size: int) -> list[bool]:
        verdicts = [self.outcome(r) is None for r in rewards]  # mixed: success rate strictly between 0 and 1
        self._step["screened"] += len(verdicts)
        self._step["continued"] += sum(verdicts)
        return verdicts

    def observe(self, questions: list[int], rewards: list[QuestionRewards], step: int) -> None:
        self.screened += self._step["screened"]
        self.continued += self._step["continued"]
        self._step = {"screened": 0, "continued": 0}

    def expected_pass_rate(self) -> float | None:
        if self.screened == 0:
            return None
        return max(self.continued / self.screened, PASS_RATE_FLOOR)

    def metrics(self) -> dict[str, float]:
        rate = self.expected_pass_rate()
        return {} if rate is None else {"select/pass_rate": rate}

    def state_dict(self) -> dict[str, Any]:
        return {"screened": self.screened, "continued": self.continued}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # "passed": the key checkpoints written before the rename hold
        self.screened, self.continued = int(state["screened"]), int(state.get("continued", state.get("passed", 0)))
        self._step = {"screened": 0, "continued": 0}
