"""`dapo`: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., arXiv 2503.14476).

Four changes relative to GRPO:
- clip-higher: the ratio may rise to 1 + 0.28 but fall only to 1 - 0.2. Low-probability tokens can grow, which
  keeps entropy from collapsing.
- token-level loss: one mean over every token of the step (global count, across ranks and accumulation steps),
  so long completions are not down-weighted.
- dynamic sampling: groups whose completions are all right or all wrong teach nothing. The paper (eq. 11,
  0 < |{correct}| < G) and its verl recipe test the *accuracy* of a group, not its shaped reward: with a format
  component or the overlong penalty an all-correct group would otherwise survive and train on format or length
  differences alone. `filter_on=accuracy` (default) drops groups whose completions all pass or all fail the task's
  pass criterion (`gpo.types.passes` on its `accuracy` component, or the component the task names, e.g.
  `task.pass_criterion` of `task=dataset`); `filter_on=total` drops groups whose shaped total is constant (for
  tasks that report no pass criterion). Dropped groups are refilled by the allocator with other questions.
- overlong reward shaping: a soft penalty in the last `buffer` tokens before the length limit, added to the
  reward. The paper prefers it to masking truncated completions, which remains available as `mask_truncated`.
There is no KL term (beta 0), so no reference model, and no dual clip (verl's DAPO recipe sets `dual_clip: 10`).
The advantage epsilon is 1e-6, the value in the paper's code (verl); TRL uses 1e-4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

from torch import Tensor

from gpo import ops
from gpo.algorithms.base import BaseObjective, ObjectiveConfig, PPOClip, StdScaledAdvantages
from gpo.errors import UserError
from gpo.registry import register
from gpo.schema import NonNegative, PositiveInt
from gpo.types import RolloutBatch


@dataclass(frozen=True)
class DAPOConfig(ObjectiveConfig, PPOClip, StdScaledAdvantages):
    epsilon_high: NonNegative = 0.28  # clip-higher
    beta: NonNegative = 0.0  # the paper drops the KL term
    std_eps: NonNegative = 1e-6  # verl's value (the paper's code)
    dynamic_sampling: bool = True  # drop groups with nothing to learn from (see filter_on)
    filter_on: Literal["accuracy", "total"] = "accuracy"  # what must vary: the pass criterion (eq. 11) | shaped total
    overlong_penalty: bool = True  # soft overlong punishment added to the reward
    overlong_buffer: PositiveInt | None = None  # tokens before the limit where the penalty ramps; null: 20% of it
    overlong_factor: NonNegative = 1.0  # penalty at the length limit
    mask_truncated: bool = False  # drop truncated completions from the loss (the paper uses the penalty instead)


# The paper's buffer is 4096 tokens of a 20480-token limit; as a share of the limit it carries to other limits.
DEFAULT_BUFFER_SHARE = 4096 / 20480


@register("algo", "dapo", config=DAPOConfig)
class DAPO(BaseObjective):
    """DAPO: clip-higher 0.2/0.28, global token-mean loss, dynamic sampling, soft overlong penalty, beta 0."""

    aggregate = staticmethod(ops.token_mean)

    def __init__(self, cfg: DAPOConfig, max_completion_length: int | None = None) -> None:
        super().__init__(cfg, max_completion_length)
        self.buffer = cfg.overlong_buffer
        self.penalty: Callable[[Tensor], Tensor] | None = None  # lengths [B, G] -> reward added [B, G]
        if cfg.overlong_penalty:
            if max_completion_length is None:
                raise UserError(
                    "dapo's overlong penalty needs train.max_completion_length (or set algo.overlong_penalty=false)."
                )
            if self.buffer is None:
                self.buffer = max(1, round(DEFAULT_BUFFER_SHARE * max_completion_length))
            if self.buffer > max_completion_length:  # >= 1 is its annotation's (or the default's, max(1, ...))
                raise UserError(
                    f"algo.overlong_buffer must be in 1..train.max_completion_length={max_completion_length}, "
                    f"got {self.buffer}."
                )
            self.penalty = partial(ops.overlong_penalty, max_length=max_completion_length, buffer=self.buffer,
                                   factor=cfg.overlong_factor)

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
        if self.penalty is None:
            return rewards
        return rewards + self.penalty(lengths).to(rewards.dtype)  # [B, G]

    def group_filter(self, rewards: Tensor, components: dict[str, Tensor], passed: Tensor | None = None) -> Tensor:
        if not self.cfg.dynamic_sampling:
            return super().group_filter(rewards, components, passed)  # [B]
        if self.cfg.filter_on == "total":
            return ~ops.zero_variance_groups(rewards)  # [B]
        if passed is not None:  # the step's verdicts by the task's pass criterion: 0 < passing < G
            return ~ops.zero_variance_groups(passed.float())  # [B]
        # A caller without verdicts (a check of the objective alone) gets the filter as it always was: the
        # `accuracy` component's own values must vary.
        if "accuracy" not in components:
            raise UserError(
                f"algo.filter_on=accuracy needs the task's pass criterion (its `accuracy` reward component unless the "
                f"task names another), but it reports {sorted(components) or 'none'}; set algo.filter_on=total to "
                f"filter on the shaped total reward."
            )
        return ~ops.zero_variance_groups(components["accuracy"])  # [B]

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        if not self.cfg.mask_truncated:
            return super().loss_mask(batch)
        return batch.completion_mask * (~batch.truncated.bool()).unsqueeze(1).to(batch.completion_mask.dtype)
