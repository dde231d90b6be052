"""`dapo`: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., arXiv 2503.14476).

Four changes relative to GRPO:
- clip-higher: the ratio may rise to 1 + 0.28 but fall only to 1 - 0.2. Low-probability tokens can grow, which
  keeps entropy from collapsing.
- token-level loss: one mean over every token of the step (global count, across ranks and accumulation steps),
  so long completions are not down-weighted.
- dynamic sampling: groups whose completions are all right or all wrong teach nothing. The paper (eq. 11,
  0 < |{correct}| < G) and its verl recipe test the *accuracy* of a group, not its shaped reward: with a format
  component or the overlong penalty an all-correct group would otherwise survive and train on format or length
  differences alone. `filter_on=accuracy` (default) drops groups whose task `accuracy` component is constant;
  `filter_on=total` drops groups whose shaped total is constant (the behaviour before, for tasks that report no
  accuracy). Dropped groups are refilled by the allocator with other questions.
- overlong reward shaping: a soft penalty in the last `buffer` tokens before the length limit, added to the
  reward. The paper prefers it to masking truncated completions, which remains available as `mask_truncated`.
There is no KL term (beta 0), so no reference model. The advantage epsilon is 1e-6, the value in the paper's code
(verl); TRL uses 1e-4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gpo import ops
from gpo.errors import UserError
from gpo.registry import register
from gpo.types import RolloutBatch, StepTotals


@dataclass
class DAPOConfig:
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28  # clip-higher
    beta: float = 0.0  # the paper drops the KL term
    kl_estimator: str = "k3"  # used only when beta > 0
    kl_clamp: float | None = None
    dual_clip: float | None = None  # verl's DAPO recipe sets 10; the paper does not use it
    is_correction: str = "token"  # token | sequence | none: weigh losses by min(pi_old / pi_sampler, is_cap)
    is_cap: float = 2.0  # truncation of those weights; they apply only with a backend that reports log-probs (vllm)
    std_eps: float = 1e-6  # verl's value (the paper's code)
    dynamic_sampling: bool = True  # drop groups with nothing to learn from (see filter_on)
    filter_on: str = "accuracy"  # accuracy (paper, eq. 11) | total: which reward must vary within a kept group
    overlong_penalty: bool = True  # soft overlong punishment added to the reward
    overlong_buffer: int | None = None  # tokens before the limit where the penalty ramps; null: 20% of the limit
    overlong_factor: float = 1.0  # penalty at the length limit
    mask_truncated: bool = False  # drop truncated completions from the loss (the paper uses the penalty instead)


# The paper's buffer is 4096 tokens of a 20480-token limit; as a share of the limit it carries to other limits.
DEFAULT_BUFFER_SHARE = 4096 / 20480
FILTER_ON = ("accuracy", "total")


@register("algo", "dapo", config=DAPOConfig)
class DAPO:
    """DAPO: clip-higher 0.2/0.28, global token-mean loss, dynamic sampling, soft overlong penalty, beta 0."""

    def __init__(self, cfg: DAPOConfig, mu: int = 1, max_completion_length: int | None = None) -> None:
        if mu < 1:
            raise UserError(f"train.mu (policy updates per generation) must be >= 1, got {mu}.")
        if cfg.filter_on not in FILTER_ON:
            raise UserError(f"algo.filter_on must be one of {', '.join(FILTER_ON)}, got `{cfg.filter_on}`.")
        self.cfg = cfg
        self.max_length = max_completion_length
        self.buffer = cfg.overlong_buffer
        if cfg.overlong_penalty:
            if max_completion_length is None:
                raise UserError(
                    "dapo's overlong penalty needs train.max_completion_length (or set algo.overlong_penalty=false)."
                )
            if self.buffer is None:
                self.buffer = max(1, round(DEFAULT_BUFFER_SHARE * max_completion_length))
            if not 0 < self.buffer <= max_completion_length:
                raise UserError(
                    f"algo.overlong_buffer must be in 1..train.max_completion_length={max_completion_length}, "
                    f"got {self.buffer}."
                )
        self.policy_loss = ops.PolicyLoss.from_config(cfg)
        self.needs_ref_logprobs = cfg.beta > 0
        self.needs_old_logprobs = mu > 1

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
        if not self.cfg.overlong_penalty:
            return rewards
        penalty = ops.overlong_penalty(lengths, self.max_length, self.buffer, self.cfg.overlong_factor)  # [B, G]
        return rewards + penalty.to(rewards.dtype)

    def group_filter(self, rewards: Tensor, components: dict[str, Tensor]) -> Tensor:
        if not self.cfg.dynamic_sampling:
            return torch.ones(rewards.shape[0], dtype=torch.bool)  # [B]
        if self.cfg.filter_on == "total":
            return ~ops.zero_variance_groups(rewards)  # [B]
        if "accuracy" not in components:
            raise UserError(
                f"algo.filter_on=accuracy needs the task's `accuracy` reward component, but it reports "
                f"{sorted(components) or 'none'}; set algo.filter_on=total to filter on the shaped total reward."
            )
        return ~ops.zero_variance_groups(components["accuracy"])  # [B]

    def advantages(self, rewards: Tensor) -> Tensor:
        return ops.group_advantages(rewards, scale_by_std=True, eps=self.cfg.std_eps)  # [B, G]

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        if not self.cfg.mask_truncated:
            return batch.completion_mask
        return batch.completion_mask * (~batch.truncated.bool()).unsqueeze(1).to(batch.completion_mask.dtype)

    def loss(self, logp: Tensor, batch: RolloutBatch, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        return self.policy_loss(logp, batch, self.loss_mask(batch), totals, ops.token_mean)
