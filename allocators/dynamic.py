"""`dynamic`: CPPO's dynamic completion allocation (arXiv 2503.22342, "b/(1-P)" rule).

Relative to GRPO: pruning keeps only k of each question's G completions, so a fixed B questions would leave most of
the B*G training rows empty. This allocator draws ceil(B*G / k) questions instead (ceil(B/(1-P)) for an exact P),
generating G completions for each, so the kept completions fill the same B*G slots a GRPO step trains on.
When group filtering (DAPO) or a data-dependent pruner (threshold) leaves slots empty, it draws more questions in
further rounds, up to `max_rounds`.

With a selector (selector=screen/greso/mopps) the engine also passes `pass_rate`, the share of candidates the
selector expects to reach a whole group (gpo.types.Selector.expected_pass_rate), so a step draws
ceil(B*G / (k * pass_rate)) candidates and the survivors still fill the B*G slots; what the estimate misses is
refilled within `max_rounds`, and selectors floor their estimate at 1/8, so a step never draws more than 8x.
`rate`, when set, replaces the pruner's k only: the selector's pass rate still applies.

What differs from the CPPO paper's released code (arXiv 2503.22342): every count is an integer computed with ceil and
checked, and the group size stays G for any P (the reference built groups of int(G*(1-P)) * int(1/(1-P)), so
G=16 with P=0.6 gave groups of 12); question counts are multiples of the world size; refills exist at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpo.allocators.static import StepLedger, check_layout, whole_ranks
from gpo.errors import UserError
from gpo.quota import kept_per_group as kept_for_rate
from gpo.registry import register
from gpo.schema import PositiveInt, Rate


@dataclass(frozen=True)
class DynamicConfig:
    rate: Rate | None = None  # P; when set, k = G - round(G*P) replaces the pruner's estimate of kept per group
    max_rounds: PositiveInt = 3  # 1 = the paper (no refill); top-k without group filtering fills in round 1 anyway
    adapt: bool = True  # with no estimate (threshold pruner), size a step by the kept-per-question seen so far


@register("allocator", "dynamic", config=DynamicConfig)
class DynamicAllocator:
    """Draw ceil(B*G / k) questions so the k kept per question fill a GRPO step's B*G rows; refill what stays empty."""

    def __init__(self, cfg: DynamicConfig) -> None:
        self.cfg = cfg
        self.step = StepLedger()
        self.seen_kept = 0  # rows kept over all finished steps (filtering and pruning included)
        self.seen_questions = 0  # questions drawn over all finished steps
        self._step_open = False

    def first_round(self, slots: int, group_size: int, kept_per_group: float | None, world_size: int,
                    pass_rate: float = 1.0) -> int:
        check_layout(slots, group_size, world_size)
        self._finish_step()
        k = self._yield(group_size, kept_per_group, pass_rate)
        if k is None and self.cfg.adapt and self.seen_kept > 0:
            k = self.seen_kept / self.seen_questions
        questions = math.ceil(slots / group_size) if k is None else math.ceil(slots / k)
        self._step_open = True
        return self.step.start(slots, whole_ranks(questions, world_size))

    def next_round(self, slots_left: int, rounds_done: int, group_size: int, kept_per_group: float | None,
                   world_size: int, pass_rate: float = 1.0) -> int:
        # The step's yield is folded into the running totals at the next step (or checkpoint), not here: a round
        # still generating its second phase makes the engine ask again once its rows are known.
        self.step.add(slots_left, 0)
        if rounds_done >= self.cfg.max_rounds or slots_left <= 0:
            return 0
        k = self._yield(group_size, kept_per_group, pass_rate)
        if k is None:  # no estimate: use what this step's rounds actually kept per question, or a full group
            yielded = (self.step.slots - slots_left) / self.step.questions
            k = yielded if yielded > 0 else float(group_size)
        return self.step.add(slots_left, whole_ranks(math.ceil(slots_left / k), world_size))

    def metrics(self) -> dict[str, float]:
        return self.step.metrics()

    def state_dict(self) -> dict[str, Any]:
        self._finish_step()
        return {"seen_kept": self.seen_kept, "seen_questions": self.seen_questions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen_kept = int(state["seen_kept"])
        self.seen_questions = int(state["seen_questions"])
        self._step_open = False

    def _yield(self, group_size: int, estimate: float | None, pass_rate: float) -> float | None:
        """Rows expected per candidate drawn: kept per whole group (from `rate`, or the pruner's estimate) times
        the selector's pass rate; None without a kept estimate."""
        if not 0 < pass_rate <= 1:
            raise UserError(f"dynamic allocator: the selector expects a pass rate of {pass_rate}; it must be in "
                            "(0, 1].")
        if self.cfg.rate is not None:
            return kept_for_rate(group_size, rate=self.cfg.rate) * pass_rate
        if estimate is not None and not 0 < estimate <= group_size:
            raise UserError(f"dynamic allocator: the pruner expects {estimate} kept per group of {group_size}; "
                            f"it must be in (0, {group_size}].")
        return None if estimate is None else estimate * pass_rate

    def _finish_step(self) -> None:
        """Fold the last step's yield into the running totals once (kept may exceed slots: slots_left < 0)."""
        if self._step_open:
            self.seen_kept += self.step.slots - self.step.slots_left
            self.seen_questions += self.step.questions
            self._step_open = False
