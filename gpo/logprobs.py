"""Per-token log-probabilities of completions, without full-vocabulary float32 logits for a whole batch.

The decoder runs once over prompt+completion; the LM head and log-softmax then run over chunks of at most
`chunk_size` positions, each chunk re-computed in the backward pass (activation checkpointing), so peak memory
holds one chunk of [chunk, V] logits instead of [n, L, V].
`TokenLogprobs` is an nn.Module so that Accelerate/DeepSpeed can wrap it: its forward is the training forward,
and gradients flow through the wrapper's hooks (calling a wrapped model's sub-modules directly would bypass them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gpo.types import RolloutBatch


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as transformers' generate computes them (so log-probs agree)."""
    positions = attention_mask.long().cumsum(dim=-1) - 1  # [n, T]
    return positions.clamp(min=0)


class TokenLogprobs(nn.Module):
    """logp[i, t] = log softmax(lm_head(h) / temperature)[completion_ids[i, t]] for the completion positions."""

    def __init__(self, model: nn.Module, chunk_size: int = 1024) -> None:
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                temperature: float = 1.0) -> Tensor:
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [n, Lp + L]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        # Padding after EOS is masked out of the loss anyway; attending to it would only change padded positions.
        hidden = self.model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask), use_cache=False,
        ).last_hidden_state  # [n, Lp + L, H]
        start = prompt_ids.shape[1] - 1  # the state before completion token t predicts token t
        h = hidden[:, start : start + completion_ids.shape[1]]  # [n, L, H]
        head = self.model.get_output_embeddings()
        flat_h = h.reshape(-1, h.shape[-1])  # [n*L, H]
        flat_ids = completion_ids.reshape(-1)  # [n*L]
        parts = []
        for lo in range(0, flat_h.shape[0], self.chunk_size):
            args = (flat_h[lo : lo + self.chunk_size], flat_ids[lo : lo + self.chunk_size], head.weight,
                    head.bias, temperature)
            if torch.is_grad_enabled():
                parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
            else:
                parts.append(_chunk_logprobs(*args))
        return torch.cat(parts).view(completion_ids.shape)  # [n, L]


def _chunk_logprobs(h: Tensor, ids: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    logits = nn.functional.linear(h, weight, bias).float() / temperature  # [c, V] float32, one chunk only
    return logits.log_softmax(dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [c]


def micro_batches(batch: RolloutBatch, size: int) -> Iterator[RolloutBatch]:
    """Consecutive slices of `size` rows, each re-trimmed to its own longest completion."""
    for lo in range(0, len(batch), size):
        yield batch.select(torch.arange(lo, min(lo + size, len(batch))))


@torch.no_grad()
def batch_logprobs(module: Any, batch: RolloutBatch, micro_batch_size: int, temperature: float) -> Tensor:
    """[N, L] log-probs for every row of `batch` (old-policy or reference pass), padded to the batch's width."""
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
    row = 0
    for mb in micro_batches(batch, micro_batch_size):
        logp = module(mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask, temperature)
        out[row : row + len(mb), : logp.shape[1]] = logp.float().cpu()
        row += len(mb)
    return out
