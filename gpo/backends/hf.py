"""`hf`: generation with transformers' `generate` on the training model itself (no copy, so no weight sync)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpo.registry import register
from gpo.types import Sampling


@dataclass
class HFConfig:
    batch_size: int = 64  # completions per generate call; bounds the KV cache


@register("backend", "hf", config=HFConfig)
class HFBackend:
    """transformers generate on the policy itself: batched sampling with left padding (default; runs on CPU)."""

    def __init__(self, cfg: HFConfig, model: Any = None, tokenizer: Any = None) -> None:
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling, seed: int) -> list[list[int]]:
        from gpo.rollout import pad

        model, tok = self.model, self.tokenizer
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        per_call = max(1, self.cfg.batch_size // n)  # prompts per generate call
        out: list[list[int]] = []
        try:
            for lo in range(0, len(prompts), per_call):
                chunk = prompts[lo : lo + per_call]
                ids, mask = pad(chunk, tok.pad_token_id, left=True)  # [b, Lp]
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
                # A seed per call (derived from the step seed) makes a run reproducible whatever ran before.
                with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
                    torch.manual_seed(seed + lo)
                    seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
                new = seqs[:, ids.shape[1] :].cpu()  # [b*n, <=max_new_tokens]
                for row in new.tolist():
                    out.append(_until_eos(row, tok.eos_token_id))
        finally:
            model.train(was_training)
        return out

    def sampled_logprobs(self) -> None:
        return None  # it samples from the training model itself: no generator/trainer mismatch to correct

    def sync_weights(self, model: Any) -> None:
        self.model = model  # generates with the training model's own parameters


def _until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row
