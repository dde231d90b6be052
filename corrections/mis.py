"""`mis`: masked importance sampling. Tokens (or whole sequences) whose ratio pi_old / pi_generator leaves the band
[lower, upper] are dropped from the loss and from its denominators; the others are weighted by their ratio.

Peers: TRL's GRPOTrainer `vllm_importance_sampling_mode="token_mask"` / `"sequence_mask"` (its default, with
`vllm_importance_sampling_clip_max` 3.0 and no lower bound): ratios outside [clip_min, clip_max] are set to 0 and
the tokens left keep the ratio as their weight. verl's `rollout_correction` `rollout_rs: token | sequence |
geometric` with `rollout_rs_threshold` (default 2.0) and `rollout_rs_threshold_lower` (default 1/upper): the
rejected tokens leave the response mask, so they leave the loss's denominators; the others get weight 1 unless
`rollout_is` adds truncated weights. slime's masked IS (its PR #657) also takes masked tokens out of the
denominator. OpenRLHF names a sequence-masking variant `seq-mask-tis`.

Where gpo differs:
- Kept tokens are weighted by the ratio (TRL, slime) by default; `weighted=false` gives weight 1 (verl's
  `rollout_rs` alone). Dropped tokens always leave the denominators (verl, slime): TRL zeroes their weight but
  still counts them, so its loss on a batch with dropped tokens is smaller by the share dropped.
- The sequence ratio is the product of the token ratios (TRL's `sequence_mask`, verl's `sequence`), not verl's
  `geometric` mean; the band test is done in log space, so long rows neither overflow nor underflow.
- lower = 0 means no lower bound (TRL's default); verl defaults to 1/upper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import torch
from torch import Tensor

from gpo.corrections.ratios import Level, log_ratios
from gpo.errors import UserError
from gpo.registry import register
from gpo.schema import Ge, Le
from gpo.types import Corrected

# The band must hold 1: a token where generator and trainer agree is never dropped.
Lower = Annotated[float, Ge(0), Le(1)]
Upper = Annotated[float, Ge(1)]


def masked_weights(old_logprobs: Tensor, generator_logprobs: Tensor, loss_mask: Tensor, lower: float, upper: float,
                   level: str = "token", weighted: bool = True) -> Corrected:
    """MIS: a token stays in the loss (the token mask) where lower <= rho <= upper, rho per token (`token`) or
    prod_t rho_t per row (`sequence`, on each of its tokens); w = rho where it stays (1 with `weighted` false), 0
    where dropped.

    The test is log(lower) <= log rho <= log(upper) (lower 0: no lower bound). Padding stays in the token mask with
    weight 1. Inputs [n, L]; no gradient flows.
    """
    m = loss_mask.bool()
    log_rho = log_ratios(old_logprobs, generator_logprobs, m, level)  # [n, L]
    log_lower = math.log(lower) if lower > 0 else -math.inf
    in_band = ((log_rho >= log_lower) & (log_rho <= math.log(upper))) | ~m  # [n, L]
    band_weight = torch.exp(log_rho.clamp(max=math.log(upper))) if weighted else torch.ones_like(log_rho)
    weights = torch.where(in_band, band_weight, 0.0).masked_fill(~m, 1.0)  # [n, L]
    return Corrected(weights=weights, mask=in_band, truncated=torch.zeros_like(m))


def check_band(lower: float, upper: float, kind: str) -> None:
    """The cross-field rule of a band: lower < upper (each bound's own range is its field's annotation)."""
    if not lower < upper:
        raise UserError(f"`{kind}.lower`={lower} is not below `{kind}.upper`={upper}: the band [lower, upper] of "
                        f"allowed ratios pi_old / pi_generator would be empty or a single point. Set "
                        f"lower < 1 < upper, e.g. {kind}.lower=0.5 {kind}.upper=2.")


@dataclass(frozen=True)
class MISConfig:
    """Ratios outside [lower, upper] are dropped; `weighted` weighs the others by their ratio."""

    level: Level = "sequence"  # TRL's default mode, sequence_mask
    lower: Lower = 0.0  # 0: no lower bound (TRL's default); verl's default is 1 / upper
    upper: Upper = 3.0  # TRL's vllm_importance_sampling_clip_max
    weighted: bool = True

    def __post_init__(self) -> None:
        check_band(self.lower, self.upper, "correction")


@register("correction", "mis", config=MISConfig)
class MaskedIS:
    """Masked importance sampling: drop tokens or sequences whose pi_old / pi_generator leaves [lower, upper]."""

    masks = True

    def __init__(self, cfg: MISConfig) -> None:
        self.cfg = cfg

    def correct(self, old_logprobs: Tensor, generator_logprobs: Tensor, loss_mask: Tensor) -> Corrected:
        C = self.cfg
        return masked_weights(old_logprobs, generator_logprobs, loss_mask, C.lower, C.upper, C.level, C.weighted)
