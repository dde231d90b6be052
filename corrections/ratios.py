"""What the corrections share: the trainer-to-generator log-ratio, per token or per sequence, and the result record.

A separate generator (vLLM, or gpo's own decoder in another precision) samples from pi_generator, which differs slightly
from the trainer's pi_old for the same weights (other kernels, other precision). Every correction starts from
log rho = log pi_old - log pi_generator on the loss tokens. Ratios are kept in log space: a sequence's product of token
ratios overflows float32 long before a cap or band is applied.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from gpo.types import Corrected

Level = Literal["token", "sequence"]  # the type of a config field that picks one ratio per token or per sequence


def log_ratios(old_logprobs: Tensor, generator_logprobs: Tensor, loss_mask: Tensor, level: str) -> Tensor:
    """[n, L] log rho on the loss tokens (0 elsewhere), computed without gradient.

    `token`: log rho_t = log pi_old(y_t) - log pi_generator(y_t). `sequence`: the row's sum over its loss tokens,
    log prod_t rho_t = log pi_old(y) - log pi_generator(y), on each of its tokens.
    """
    m = loss_mask.bool()
    log_rho = (old_logprobs.detach().float() - generator_logprobs.float()).masked_fill(~m, 0.0)  # [n, L]
    if level == "sequence":
        log_rho = log_rho.sum(dim=1, keepdim=True).expand_as(log_rho)  # [n, L]
    elif level != "token":
        raise ValueError(f"a correction's level is `token` or `sequence`, got `{level}`")
    return log_rho


def unchanged(loss_mask: Tensor) -> Corrected:
    """Weight 1 on every token, all in the token mask, none truncated."""
    ones = torch.ones(loss_mask.shape, dtype=torch.float32, device=loss_mask.device)
    return Corrected(weights=ones, mask=torch.ones_like(ones, dtype=torch.bool),
                     truncated=torch.zeros_like(ones, dtype=torch.bool))
