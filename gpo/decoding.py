"""Drawing the next token: the sampling distribution as a pure function, and an inverse-CDF draw from it.

The distribution is the policy's own, softmax(logits / T), optionally restricted to the top-p nucleus with
transformers' rule (ascending sort, drop the tokens whose cumulative probability is <= 1 - top_p, keep at least
one). Nothing else from a model's `generation_config` (repetition penalty, top-k 50, ...) applies: the trainer's
log-probs are softmax(logits / T), and sampling from anything else would make the rollouts off-policy.

The draw takes one uniform number per row and finds it in the cumulative distribution. `torch.multinomial`
draws the same distribution but spent about 137 ms per decode step on 64 rows x 49k tokens on this CPU, almost
all of it random-number generation over the whole vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor


def next_token_probs(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """[b, V] logits -> [b, V] float64 probabilities of the next token (rows sum to 1)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    scaled = logits.to(torch.float64) / temperature
    if top_p < 1.0:
        ascending, order = torch.sort(scaled, dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - top_p
        drop_sorted[:, -1] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.softmax(dim=-1)


def draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Token ids [b]: row i takes the token whose cumulative-probability interval holds uniforms[i] in [0, 1).

    Exactly the categorical distribution `probs` [b, V]: token j is chosen when cdf[j-1] <= u*total < cdf[j], an
    interval of length probs[j]; tokens of probability 0 have an empty interval and are never chosen.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [b, V]
    target = (uniforms.to(torch.float64) * cdf[:, -1]).unsqueeze(1)  # [b, 1]
    token = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [b]
    # u * total can round up to total itself; the last token of positive probability is then the right pick.
    last_positive = probs.shape[1] - 1 - torch.argmax((probs.flip(-1) > 0).int(), dim=-1)  # [b]
    return torch.minimum(token, last_positive)
