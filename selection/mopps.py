"""`mopps`: MoPPS, model-predictive prompt selection (Qu et al., arXiv 2507.04632; thu-rllab/MoPPS).

Relative to GRPO: every question carries a Beta(alpha, beta) posterior of its success rate, updated from its own
rollouts (alpha += successes, beta += failures, after discounting the old evidence by `decay` towards the prior).
A success is a completion that passes the task's pass criterion (`judge_on=accuracy`, selection/base.py): 3 right
answers of 8 take the uniform prior to Beta(4, 6) however many of the wrong ones were well formatted.
Before generation a success rate is Thompson-sampled for each candidate, and only those whose sample is nearest to
`target` (0.5: the questions whose groups are most likely mixed, hence carry advantage) get rollouts: the
`keep_fraction` nearest, or, with `band: [low, high]`, every candidate whose sample lies in the band.

The released code (thu-rllab/MoPPS, recipe/ours/our_ray_trainer.py) draws a candidate batch `ts_ratio` times the
training batch and keeps a training batch of it (here keep_fraction = 1 / ts_ratio), and scores each query by its
mean accuracy with a response counting as right at accuracy >= 1. Its posterior sampler (recipe/ours/mpts_llm.py)
was not in the index read for this port, so the update and `decay` below follow the paper's description.

Where gpo differs, and why:
- The candidate set is what the allocator draws this round (it draws 1/keep_fraction times as many, through the
  pass estimate), so the step still fills its B*G slots whatever the fraction.
- MoPPS works with binary verifier rewards only; with `judge_on=total` (or a task without a pass criterion) a
  completion counts as a success when its total reward is >= `success_threshold`.
- `decay` (default 1.0, no forgetting) is exposed because the policy moves.
- Thompson draws come from a generator seeded by (run seed, step, round): every rank and every resume agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gpo.errors import UserError
from gpo.registry import register
from gpo.schema import Fraction, Positive
from gpo.selectors.base import PASS_RATE_FLOOR, JudgingSelector, PositiveFraction, SelectorConfig
from gpo.types import QuestionRewards


@dataclass(frozen=True)
class MoppsConfig(SelectorConfig):
    target: Fraction = 0.5  # the success rate a kept question is nearest to
    keep_fraction: PositiveFraction = 0.5  # share of the candidates kept (ignored when `band` is set)
    # e.g. [0.3, 0.7]: keep every candidate whose sampled rate lies inside
    band: tuple[Fraction, Fraction] | None = None
    prior_alpha: Positive = 1.0  # Beta(1, 1): uniform prior
    prior_beta: Positive = 1.0
    decay: PositiveFraction = 1.0  # old evidence is scaled by this before each update (1: none forgotten)


@register("selector", "mopps", config=MoppsConfig)
class Mopps(JudgingSelector):
    """MoPPS: Thompson-sample each question's Beta posterior; generate for those nearest a 0.5 success rate."""

    cfg: MoppsConfig

    def __init__(self, cfg: MoppsConfig) -> None:
        if cfg.band is not None and not cfg.band[0] < cfg.band[1]:  # each end in [0, 1] by its type
            raise UserError(f"selector.band must be [low, high] with low < high, got {list(cfg.band)}.")
        super().__init__(cfg)
        self.posterior: dict[int, tuple[float, float]] = {}  # question -> (alpha, beta)
        self.kept_frac: float | None = cfg.keep_fraction if cfg.band is None else None

    def first_phase(self, questions: list[int], group_size: int, seed: int) -> list[int]:
        if not questions:
            return []
        C = self.cfg
        ab = [self.posterior.get(q, (C.prior_alpha, C.prior_beta)) for q in questions]
        alpha = torch.tensor([a for a, _ in ab], dtype=torch.float64)
        beta = torch.tensor([b for _, b in ab], dtype=torch.float64)
        sampled = beta_sample(alpha, beta, seed)  # [n]
        if C.band is not None:
            chosen = ((sampled >= C.band[0]) & (sampled <= C.band[1])).tolist()
            self.kept_frac = sum(chosen) / len(chosen)
        else:
            n_chosen = math.ceil(C.keep_fraction * len(questions))
            # Ties in distance break by position (a stable sort), never by an unspecified order.
            order = torch.sort((sampled - C.target).abs(), stable=True).indices[:n_chosen]
            chosen = [False] * len(questions)
            for i in order.tolist():
                chosen[i] = True
        return [group_size if c else 0 for c in chosen]

    def observe(self, questions: list[int], rewards: list[QuestionRewards], step: int) -> None:
        C = self.cfg
        for q, r in zip(questions, rewards, strict=True):
            if not len(r):  # skipped this round: no evidence
                continue
            right = self.successes(r)
            a, b = self.posterior.get(q, (C.prior_alpha, C.prior_beta))
            a = C.decay * a + (1 - C.decay) * C.prior_alpha + right
            b = C.decay * b + (1 - C.decay) * C.prior_beta + (len(r) - right)
            self.posterior[q] = (a, b)

    def expected_pass_rate(self) -> float | None:
        return None if self.kept_frac is None else max(self.kept_frac, PASS_RATE_FLOOR)

    def metrics(self) -> dict[str, float]:
        if not self.posterior:
            return {}
        means = [a / (a + b) for a, b in self.posterior.values()]
        return {"select/posterior_mean": sum(means) / len(means), "select/tracked": float(len(means))}

    def state_dict(self) -> dict[str, Any]:
        return {"posterior": {int(q): [a, b] for q, (a, b) in self.posterior.items()}, "kept_frac": self.kept_frac}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.posterior = {int(q): (float(a), float(b)) for q, (a, b) in state["posterior"].items()}
        self.kept_frac = state["kept_frac"]


def beta_sample(alpha: Tensor, beta: Tensor, seed: int) -> Tensor:
    """[n] Beta(alpha, beta) draws from a generator seeded by `seed` alone (numpy's: torch.distributions draws from
    the global RNG only), so the same seed gives the same draws on every rank and after a resume."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.beta(alpha.numpy(), beta.numpy()))
