"""`hf`: generation on the training model itself (no copy, so no weight sync).

The default decoder prefills each distinct prompt once and expands its keys/values to the prompt's n samples:
`generate` with n copies of a prompt prefilled it n times (about 28% of generation at the default size). It then
decodes token by token, drawing each token from softmax(logits / T) (top-p optional) with one uniform number per
row (gpo/decoding.py), and drops finished rows from the batch and the cache. `backend.decode=generate` keeps
transformers' `generate` for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from gpo.decoding import draw, next_token_weights
from gpo.registry import register
from gpo.schema import PositiveInt
from gpo.types import Sampling


@dataclass(frozen=True)
class HFConfig:
    batch_size: PositiveInt = 64  # completions per call; bounds the KV cache
    # gpo: one prefill per distinct prompt, its keys/values expanded to the prompt's n samples, then a decode loop
    #      that draws each token by inverse CDF and stops computing rows that have finished.
    # generate: transformers' `generate` on n copies of each prompt (the path before; kept for comparison).
    decode: Literal["gpo", "generate"] = "gpo"


@register("backend", "hf", config=HFConfig)
class HFBackend:
    """Generation on the policy itself: one prefill per prompt shared by its samples (default; runs on CPU)."""

    generates_with_policy = True  # the training model's own forward passes: ZeRO-3 gathers it around generate

    def __init__(self, cfg: HFConfig, model: Any = None, tokenizer: Any = None) -> None:
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer

    @property
    def per_prompt_counts(self) -> bool:
        """gpo's decoder takes a completion count per prompt (`generate` takes one n per call)."""
        return self.cfg.decode == "gpo"

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int | list[int], sampling: Sampling,
                 seed: int) -> list[list[int]]:
        from gpo.generation import counts_per_prompt, pad

        model, tok = self.model, self.tokenizer
        counts = counts_per_prompt(n, len(prompts))
        if not isinstance(n, int) and not self.per_prompt_counts:
            raise ValueError("backend.decode=generate takes one completion count per call")
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        run: Any = self._decode if self.cfg.decode == "gpo" else self._transformers_generate
        out: list[list[int]] = []
        try:
            for lo, hi in _chunks(counts, self.cfg.batch_size):
                ids, mask = pad(prompts[lo:hi], tok.pad_token_id, left=True)  # [b, Lp]
                # A seed per call (derived from the step seed) makes a run reproducible whatever ran before.
                chunk = n if isinstance(n, int) else counts[lo:hi]
                out.extend(run(ids.to(device), mask.to(device), chunk, sampling, seed + lo))
        finally:
            model.train(was_training)
        return out

    def _decode(self, ids: Tensor, mask: Tensor, n: int | list[int], sampling: Sampling,
                seed: int) -> list[list[int]]:
        """Prefill the b distinct prompts once, expand their cache to their n samples each (n per prompt, or one
        count for all), then decode token by token."""
        eos, device = self.tokenizer.eos_token_id, ids.device
        generator = torch.Generator().manual_seed(seed)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # [b, Lp]: left padding does not shift positions
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        cache = out.past_key_values
        repeats = torch.full((ids.shape[0],), n) if isinstance(n, int) else torch.tensor(n)  # [b]
        source = torch.arange(ids.shape[0]).repeat_interleave(repeats).to(device)  # [N]: each sample's prompt
        cache.batch_select_indices(source)
        logits = out.logits[:, -1][source]  # [N, V]
        mask = mask[source]  # [N, Lp]
        rows: list[list[int]] = [[] for _ in range(logits.shape[0])]
        alive = torch.arange(logits.shape[0])  # original row of each row still being decoded
        for step in range(sampling.max_new_tokens):
            if sampling.greedy:
                token = logits.argmax(dim=-1)  # [alive]
            else:
                weights = next_token_weights(logits, sampling.temperature, sampling.top_p)
                uniforms = torch.rand(len(rows), generator=generator, dtype=torch.float64)[alive]
                token = draw(weights, uniforms.to(device))
            for row, t in zip(alive.tolist(), token.tolist(), strict=True):
                rows[row].append(t)
            running = token != eos  # [alive]
            if step == sampling.max_new_tokens - 1 or not running.any():
                break
            if not running.all():  # finished rows leave the batch and the cache
                keep = running.nonzero(as_tuple=True)[0]
                cache.batch_select_indices(keep)
                alive, token, mask = alive[keep.cpu()], token[keep], mask[keep]
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)  # [alive, Lp + step + 1]
            out = self.model(input_ids=token.unsqueeze(1), attention_mask=mask,
                             position_ids=mask.sum(dim=1, keepdim=True) - 1, past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
        return rows

    def _transformers_generate(self, ids: Tensor, mask: Tensor, n: int, sampling: Sampling,
                               seed: int) -> list[list[int]]:
        tok = self.tokenizer
        kwargs: dict[str, Any] = dict(
            max_new_tokens=sampling.max_new_tokens,
            num_return_sequences=n,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            use_cache=True,
        )
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        with torch.random.fork_rng(devices=[] if ids.device.type == "cpu" else [ids.device]):
            torch.manual_seed(seed)
            seqs = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        return [_until_eos(row, tok.eos_token_id) for row in seqs[:, ids.shape[1] :].cpu().tolist()]

    def sampled_logprobs(self) -> None:
        return None  # it samples from the training model itself: no generator/trainer mismatch to correct

    def sync_weights(self, model: Any) -> None:
        self.model = model  # generates with the training model's own parameters

    def close(self) -> None:
        """Nothing to free: the model is the trainer's."""


def _chunks(counts: list[int], batch_size: int) -> list[tuple[int, int]]:
    """Consecutive prompt ranges [lo, hi) of at most batch_size completions each (at least one prompt each): the
    KV cache of one call stays bounded. With equal counts n that is batch_size // n prompts per call."""
    chunks, lo, rows = [], 0, 0
    for i, c in enumerate(counts):
        if i > lo and rows + c > batch_size:
            chunks.append((lo, i))
            lo, rows = i, 0
        rows += c
    if lo < len(counts):
        chunks.append((lo, len(counts)))
    return chunks


def _until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row
