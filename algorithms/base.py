"""What every objective shares: the settings of its config, and GRPO's parts, which an objective replaces only where
its paper differs. The maths of every part is in gpo/ops.py; this module only assembles it.

An objective is built from these parts (the methods of `gpo.types.Objective`, which the engine calls):

    part            GRPO's (the default here)              replaced by
    shape_rewards   the rewards unchanged                  dapo (soft overlong penalty)
    group_filter    every group trains                     dapo (dynamic sampling)
    advantages      (r - group mean) / (group std + eps)   dr_grpo, rloo, reinforce_pp
    loss_mask       the completion mask                    dapo (optionally without truncated rows)
    surrogate       PPO's clipped ratio per token          gspo, cispo, sapo, gmpo, rloo
    aggregate       sequence mean                          grpo (a choice), dapo, cispo, reinforce_pp, dr_grpo

The KL term and the loss metrics are the same for all (`ops.PolicyLoss`); the correction for the generator's
log-probs is a component of its own (`correction=`, gpo.corrections), which every objective takes unchanged. A
new objective's file subclasses `BaseObjective`, replaces the parts its paper changes, and registers with a config
class derived from `ObjectiveConfig` (plus the settings classes of the GRPO parts it keeps).

Config classes. `ObjectiveConfig` holds what every objective has: the KL term.
The settings of a GRPO part live with that part (`PPOClip`, `ClipRange`, `StdScaledAdvantages`), so an objective
that replaces the part does not carry settings it would ignore (SAPO has no clip range; Dr.GRPO no std epsilon).
Defaults are GRPO's; a derived config overrides one only where its paper differs, and repeats the field's
annotation when it does (the annotation carries the range the composer checks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch
from torch import Tensor

from gpo import ops
from gpo.schema import Gt, NonNegative, Positive, Rate
from gpo.types import RolloutBatch, StepTotals, loss_mask_of

DualClip = Annotated[float, Gt(1)]  # the cap -A*c, c > 1: with c <= 1 even on-policy tokens (ratio 1) were capped


@dataclass(frozen=True)
class ObjectiveConfig:
    """Every objective's settings: the KL term to a frozen reference model. Every objective's config derives from this
    class. (The correction for the generator's log-probs is `correction=`, not an objective's setting.)"""

    beta: NonNegative = 0.04  # KL coefficient (GRPO paper: 0.04); 0 loads no reference model at all
    kl_estimator: ops.KLEstimator = "k3"  # k1 | k2 | k3 (GRPO's unbiased estimator); used only when beta > 0
    kl_clamp: Positive | None = None  # bound the per-token KL estimate (verl's low_var_kl: 10)

    # Keys that left the objectives, and what says the same thing now (refused with it, gpo.schema).
    MOVED_KEYS: ClassVar[Mapping[str, str]] = {
        "is_correction": "the correction is a component of its own: `correction=tis correction.level=token` (or "
                         "sequence; `correction=none` for the old `none`, or `mis`, `icepop`)",
        "is_cap": "the cap is `correction.cap` of `correction=tis` (the default correction)",
    }


@dataclass(frozen=True)
class ClipRange:
    """Settings of a surrogate that clips the importance ratio r to [1 - epsilon_low, 1 + epsilon_high]."""

    epsilon_low: Rate = 0.2  # ratio clipped below at 1 - epsilon_low (a lower bound above 0)
    epsilon_high: NonNegative = 0.2  # and above at 1 + epsilon_high (symmetric in GRPO's paper)


@dataclass(frozen=True)
class PPOClip(ClipRange):
    """Settings of GRPO's surrogate, PPO's clipped ratio per token (`ops.clipped_surrogate`)."""

    dual_clip: DualClip | None = None  # cap negative-advantage token losses at -A*c (verl: 3); off in the paper


@dataclass(frozen=True)
class StdScaledAdvantages:
    """Settings of GRPO's advantage estimator, (r - group mean) / (group std + std_eps)."""

    std_eps: NonNegative = 1e-4  # TRL's value; verl's is 1e-6


class BaseObjective:
    """GRPO's parts, from which every objective is built (see the module docstring for who replaces what).

    A subclass replaces a part by defining it: a method (`shape_rewards`, `group_filter`, `advantages`,
    `loss_mask`, `surrogate`) or the `aggregate` attribute. Each config field's range and choices are its
    annotation, checked by the composer; a rule between two fields of one config is that config's `__post_init__`
    (raising UserError, which the composer reports as it is); the objective's `__init__` checks only what needs a
    runtime fact (the run's max_completion_length).
    """

    # The policy's per-token term, (logp, old_logp, advantages, mask) -> ops.Surrogate. None: PPO's clipped ratio
    # with the config's clip range and dual clip, which ops.PolicyLoss computes itself.
    surrogate: ops.SurrogateFn | None = None
    # A micro-batch's share of the step loss from per-token losses (gpo/ops.py: seq_mean, token_mean, ...).
    aggregate: ops.Aggregation = staticmethod(ops.seq_mean)

    def __init__(self, cfg: ObjectiveConfig, max_completion_length: int | None = None) -> None:
        self.cfg: Any = cfg  # ObjectiveConfig and the settings classes of the parts the objective keeps
        self.max_completion_length = max_completion_length
        self.needs_ref_logprobs = cfg.beta > 0
        if self.surrogate is None:
            self.policy_loss = ops.PolicyLoss.from_config(cfg)
        else:
            self.policy_loss = ops.PolicyLoss.with_surrogate(self.surrogate, cfg)

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
        return rewards  # [B, G]

    def group_filter(self, rewards: Tensor, components: dict[str, Tensor], passed: Tensor | None = None) -> Tensor:
        return torch.ones(rewards.shape[0], dtype=torch.bool)  # [B]: every group trains

    def advantages(self, rewards: Tensor) -> Tensor:
        return ops.group_advantages(rewards, scale_by_std=True, eps=self.cfg.std_eps)  # [B, G]

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        return batch.completion_mask  # [N, L]

    def loss(self, logp: Tensor, batch: RolloutBatch, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        # the step's mask (filled once from loss_mask), not a fresh call per micro-batch
        return self.policy_loss(logp, batch, loss_mask_of(self, batch), totals, self.aggregate)
