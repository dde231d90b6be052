"""Drawing the next token: the sampling distribution as a pure function, and an inverse-CDF draw from it.

The distribution is the policy's own, softmax(logits / T), optionally restricted to the top-p nucleus with
transformers' rule (ascending sort, drop the tokens whose cumulative probability is <= 1 - top_p, keep at least
one). Nothing else from a model's `generation_config` (repetition penalty, top-k 50, ...) applies: the trainer's
log-probs are softmax(logits / T), and sampling from anything else would make the rollouts off-policy.

The draw takes one uniform number per row and finds it in the cumulative distribution. `torch.multinomial`
draws the same distribution but generates random numbers over the whole vocabulary, which made it a large share
of a CPU decode step (docs/benchmarks.md, decode-step profile). The search is two-level (blocks of the vocabulary,
then tokens inside the chosen block) because a cumulative sum over the whole vocabulary is a sequential scan, the
slowest part of a one-level draw; a block sum is a vectorised reduction.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 1024  # tokens per block of the two-level search: about sqrt(V) for vocabularies of 32k-256k


def next_token_weights(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """[b, V] logits -> [b, V] float32 weights proportional to the sampling distribution, the likeliest token's
    weight 1 (so no row sums to 0). Unnormalised: `draw` needs only proportions."""
    return top_p_filter(tempered_weights(logits, temperature), top_p)


def tempered_weights(logits: Tensor, temperature: float) -> Tensor:
    """[b, V] float32 w_j = exp((l_j - max_k l_k) / T), proportional to softmax(l / T): the distribution before
    any top-p truncation, whose row sums give the log-normaliser of `sampled_logprob`."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    logits = logits.float()
    weights = logits - logits.amax(dim=-1, keepdim=True)
    if temperature != 1.0:
        weights.div_(temperature)
    return weights.exp_()


def top_p_filter(weights: Tensor, top_p: float) -> Tensor:
    """`weights` with the tokens outside the top-p nucleus set to 0, in place (transformers' rule, above)."""
    if top_p < 1.0:
        ascending, order = torch.sort(weights, dim=-1)
        cumulative = ascending.to(torch.float64).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p) * cumulative[:, -1:]
        drop_sorted[:, -1] = False  # the most likely token always stays
        weights.masked_fill_(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    return weights


def sampled_logprob(weights: Tensor, totals: Tensor, tokens: Tensor) -> Tensor:
    """[b] log softmax(l / T)[token] = log w_token - log sum_j w_j, from the drawn tokens' `weights` [b, V] and the
    row sums `totals` [b] of the tempered weights taken before top-p truncation (which leaves a drawn token's
    weight unchanged). The quantity the trainer's log-probs compute: the distribution before truncation, so the
    importance ratio compares like with like. One gather per row: no second pass over the vocabulary."""
    picked = weights.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return picked.log() - totals.log()


def next_token_probs(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """[b, V] logits -> [b, V] float64 probabilities of the next token (rows sum to 1)."""
    weights = next_token_weights(logits, temperature, top_p).to(torch.float64)
    return weights / weights.sum(dim=-1, keepdim=True)


def draw(weights: Tensor, uniforms: Tensor, block: int = BLOCK) -> Tensor:
    """Token ids [b]: row i takes the token whose cumulative-weight interval holds uniforms[i] * total_i.

    The categorical distribution weights / total ([b, V], non-negative, any positive total): token j is chosen
    when cdf[j-1] <= u*total < cdf[j], an interval of length weights[j], so a token of weight 0 has an empty
    interval and is never chosen. First the block (`block` consecutive tokens) whose interval holds u*total, then
    the token inside it, with u's place inside the block's interval. Block sums are float32 (a float64 reduction
    over the strided blocks was 25x slower here); the cumulative sums are float64. Exact up to float32 rounding of
    the block sums, about 1e-7 of a block's probability, the precision of float32 weights themselves.
    """
    rows, vocab = weights.shape
    whole = vocab - vocab % block
    sums = weights[:, :whole].unflatten(1, (whole // block, block)).sum(dim=-1)  # [b, blocks]
    if whole < vocab:  # the last, shorter block
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    sums = sums.to(torch.float64)
    block_cdf = sums.cumsum(dim=-1)  # [b, blocks]
    target = uniforms.to(torch.float64).unsqueeze(1) * block_cdf[:, -1:]  # [b, 1]
    chosen = _first_above(block_cdf, target)  # [b, 1]
    start = torch.where(chosen > 0, block_cdf.gather(1, (chosen - 1).clamp(min=0)), 0.0)  # [b, 1]: <= target
    index = chosen * block + torch.arange(block, device=weights.device)  # [b, block]: the chosen block's tokens
    inner = weights.gather(1, index.clamp(max=vocab - 1)).to(torch.float64).masked_fill(index >= vocab, 0.0)
    inner_cdf = inner.cumsum(dim=-1)  # [b, block]
    place = (target - start) / sums.gather(1, chosen) * inner_cdf[:, -1:]  # [b, 1]: u's place in the block, >= 0
    return index.gather(1, _first_above(inner_cdf, place)).squeeze(1)


def _first_above(cdf: Tensor, target: Tensor) -> Tensor:
    """[b, 1]: the first entry of each row's cumulative sum `cdf` [b, n] above target [b, 1]. Where target reaches
    the row's total (u * total can round up to it), the last entry of positive mass instead, never one past it."""
    last_positive = torch.searchsorted(cdf, cdf[:, -1:].contiguous())  # first entry equal to the total
    return torch.minimum(torch.searchsorted(cdf, target, right=True), last_positive)
