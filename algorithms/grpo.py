"""`grpo`: Group Relative Policy Optimization (Shao et al., DeepSeekMath, arXiv 2402.03300).

The reference point of the family. GRPO drops PPO's value model: each question gets G completions, and a
completion's advantage is its reward standardised within its group. The clipped PPO surrogate applies per token,
and a k3 KL penalty to a frozen reference model is added to the loss, not to the reward. The paper's loss averages
tokens within each sequence and then averages over sequences (`seq_mean`). The CPPO code and TRL's `bnpo`
average over tokens instead (`token_mean`).
Its parts are the defaults of algorithms/base.py, which every other objective starts from; the choice of
aggregation (`loss_agg`) is its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpo import ops
from gpo.algorithms.base import BaseObjective, ObjectiveConfig, PPOClip, StdScaledAdvantages
from gpo.registry import register


@dataclass(frozen=True)
class GRPOConfig(ObjectiveConfig, PPOClip, StdScaledAdvantages):
    # seq_mean (paper) | token_mean (CPPO code, TRL's bnpo; over the step's global token count)
    loss_agg: ops.LossAggregation = "seq_mean"


@register("algo", "grpo", config=GRPOConfig)
class GRPO(BaseObjective):
    """GRPO (DeepSeekMath): std-scaled group advantages, clip 0.2, k3 KL with beta 0.04, sequence-mean loss."""

    def __init__(self, cfg: GRPOConfig, max_completion_length: int | None = None) -> None:
        super().__init__(cfg, max_completion_length)
        self.aggregate = ops.AGGREGATIONS[cfg.loss_agg]
