"""`tis`: truncated importance sampling, w = min(pi_old / pi_generator, cap), per token or per sequence.

Peers: TRL's GRPOTrainer `vllm_importance_sampling_mode="token_truncate"` / `"sequence_truncate"` with
`vllm_importance_sampling_clip_max` (default 3.0); verl's `rollout_correction` `rollout_is: token | sequence` with
`rollout_is_threshold` (default 2.0); OpenRLHF's `tis`; slime's `--use-tis`. Tokens are weighted, never dropped.

Where gpo differs:
- One-sided: TRL clamps to [clip_min, clip_max] (clip_min unset by default, which is gpo's rule); gpo has no lower
  bound, as verl's `rollout_is` has none.
- The sequence ratio is the product of the row's token ratios (TRL's and verl's `sequence`), truncated in log space
  with no other bound; verl clamps every log-ratio to [-20, 20] before its exp, which changes nothing below the cap.
- The default is token level with cap 2, gpo's behaviour before corrections were a component (TRL's default is
  `sequence_mask`, gpo's `mis`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import torch
from torch import Tensor

from gpo.corrections.ratios import Level, log_ratios
from gpo.registry import register
from gpo.schema import Ge
from gpo.types import Corrected

Cap = Annotated[float, Ge(1)]  # a cap below 1 would shrink the weight 1 of tokens where generator = trainer


def truncated_weights(old_logprobs: Tensor, generator_logprobs: Tensor, loss_mask: Tensor, cap: float,
                      level: str = "token") -> Corrected:
    """TIS: w = min(rho, cap), rho = pi_old / pi_generator per token (`token`) or prod_t rho_t per row (`sequence`).

    Truncation is exp(min(log rho, log cap)), so a long row's product cannot overflow. Every token stays in the loss;
    `truncated` marks loss tokens with rho > cap. Padding gets weight 1. Inputs [n, L]; no gradient flows.
    """
    m = loss_mask.bool()
    log_rho = log_ratios(old_logprobs, generator_logprobs, m, level)  # [n, L]
    log_cap = math.log(cap)
    weights = torch.exp(log_rho.clamp(max=log_cap)).masked_fill(~m, 1.0)  # [n, L]
    return Corrected(weights=weights, mask=torch.ones_like(m), truncated=(log_rho > log_cap) & m)


@dataclass(frozen=True)
class TISConfig:
    """One ratio per token or per sequence, truncated above at `cap`."""

    level: Level = "token"
    cap: Cap = 2.0


@register("correction", "tis", config=TISConfig)
class TruncatedIS:
    """Truncated importance sampling: weigh each token by min(pi_old / pi_generator, cap) (the default)."""

    masks = False

    def __init__(self, cfg: TISConfig) -> None:
        self.cfg = cfg

    def correct(self, old_logprobs: Tensor, generator_logprobs: Tensor, loss_mask: Tensor) -> Corrected:
        return truncated_weights(old_logprobs, generator_logprobs, loss_mask, self.cfg.cap, self.cfg.level)
