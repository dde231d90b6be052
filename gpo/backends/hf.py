"""`hf`: gpo's decoder, on the training model itself (float32, the default) or on a bf16 / int8 copy of it.

The default decoder prefills each distinct prompt once and expands its keys/values to the prompt's n samples:
`generate` with n copies of a prompt prefilled it n times (about 28% of generation at the default size). It then
decodes token by token, drawing each token from softmax(logits / T) (top-p optional) with one uniform number per
row (gpo/decoding.py), and drops finished rows from the batch and the cache. `backend.decode=generate` keeps
transformers' `generate` for comparison.

`backend.precision` (gpo/backends/precision.py): float32 and auto sample with the policy itself; bf16 and int8
with a copy of it that `sync_weights` refreshes after every optimizer step. At every precision gpo's decoder
reports each sampled token's log-prob under the generator, log softmax(logits / T) before top-p truncation (the
quantity the trainer computes), for the importance correction; the comparison path `decode=generate` reports none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from gpo.backends.precision import POLICY_ITSELF, GeneratorCopy
from gpo.decoding import draw, sampled_logprob, tempered_weights, top_p_filter
from gpo.registry import register
from gpo.run_config import RunConfig, cannot_run_ahead
from gpo.schema import PRECISION_NAMES, PositiveInt
from gpo.types import Sampling


@dataclass(frozen=True)
class HFConfig:
    batch_size: PositiveInt = 64  # completions per call; bounds the KV cache
    # gpo: one prefill per distinct prompt, its keys/values expanded to the prompt's n samples, then a decode loop
    #      that draws each token by inverse CDF and stops computing rows that have finished.
    # generate: transformers' `generate` on n copies of each prompt (the path before; kept for comparison).
    decode: Literal["gpo", "generate"] = "gpo"
    # float32: sample with the policy itself (in its own dtype, float32 unless model.dtype says otherwise).
    # auto: bf16 where this machine multiplies bfloat16 natively and model.dtype is float32, float32 elsewhere
    # (gpo.config resolves it).
    # bf16: a bfloat16 copy of the policy (emulated, slower, without native bfloat16: the run says so). int8: a
    # copy whose Linear layers are int8 with activations quantised per call (CPU). Copies are refreshed after every
    # optimizer step (metric time/weight_sync). Also bfloat16, fp32.
    precision: Annotated[Literal["auto", "float32", "bf16", "int8"], PRECISION_NAMES] = "auto"

    def check_run(self, run: RunConfig) -> None:
        if run.train.max_staleness and self.decode != "gpo":
            raise cannot_run_ahead(run, "needs the generator's log-probs of its tokens, which backend.decode=generate "
                                        "does not report; use backend.decode=gpo")


@register("backend", "hf", config=HFConfig)
class HFBackend:
    """gpo's decoder: one prefill per prompt shared by its samples, on the policy or a lower-precision copy."""

    # True: the training model's own forward passes, so ZeRO-3 gathers it around generate (float32, the default).
    # A bf16 / int8 copy needs nothing gathered while it generates (it gathers for its refresh): set per instance.
    generates_with_policy = True

    def __init__(self, cfg: HFConfig, model: Any = None, tokenizer: Any = None) -> None:
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self._copy: GeneratorCopy | None = None  # bf16 / int8: made on first use, from the policy as it is then
        self._logprobs: list[list[float]] | None = None
        self.generates_with_policy = cfg.precision in POLICY_ITSELF

    def generator(self) -> Any:
        """The model that samples: the policy, or its copy at backend.precision."""
        if self.generates_with_policy:
            return self.model
        if self._copy is None:
            self._copy = GeneratorCopy(self.model, self.cfg.precision)
        return self._copy.model

    @property
    def per_prompt_counts(self) -> bool:
        """gpo's decoder takes a completion count per prompt (`generate` takes one n per call)."""
        return self.cfg.decode == "gpo"

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int | list[int], sampling: Sampling,
                 seed: int) -> list[list[int]]:
        from gpo.generation import counts_per_prompt, pad

        tok = self.tokenizer
        model = self.generator()  # a copy is made here on first use, on every rank alike (collective under ZeRO-3)
        counts = counts_per_prompt(n, len(prompts))
        if not isinstance(n, int) and not self.per_prompt_counts:
            raise ValueError("backend.decode=generate takes one completion count per call")
        report = self.cfg.decode == "gpo" and not sampling.greedy
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        out: list[list[int]] = []
        logprobs: list[list[float]] = []
        try:
            for lo, hi in _chunks(counts, self.cfg.batch_size):
                ids, mask = pad(prompts[lo:hi], tok.pad_token_id, left=True)  # [b, Lp]
                # A seed per call (derived from the step seed) makes a run reproducible whatever ran before.
                chunk = n if isinstance(n, int) else counts[lo:hi]
                if self.cfg.decode == "gpo":
                    rows, row_logprobs = self._decode(model, ids.to(device), mask.to(device), chunk, sampling,
                                                      seed + lo)
                    logprobs.extend(row_logprobs)
                else:
                    assert isinstance(chunk, int)  # checked above: decode=generate takes one count per call
                    rows = self._transformers_generate(model, ids.to(device), mask.to(device), chunk, sampling,
                                                       seed + lo)
                out.extend(rows)
        finally:
            model.train(was_training)
        self._logprobs = logprobs if report else None
        return out

    def _decode(self, model: Any, ids: Tensor, mask: Tensor, n: int | list[int], sampling: Sampling,
                seed: int) -> tuple[list[list[int]], list[list[float]]]:
        """Prefill the b distinct prompts once, expand their cache to their n samples each (n per prompt, or one
        count for all), then decode token by token. Returns the tokens and, when sampling, each token's log-prob
        under the generator (`sampled_logprob`); empty lists when greedy."""
        eos, device = self.tokenizer.eos_token_id, ids.device
        generator = torch.Generator().manual_seed(seed)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # [b, Lp]: left padding does not shift positions
        # The last position as an index tensor, not logits_to_keep=1: that slice is a strided view, and a bf16 LM
        # head over a strided 3-D input expands its weight per prompt (a [b, d, V] copy, about 1 s for SmolLM2).
        last = torch.tensor([ids.shape[1] - 1], device=device)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=last)
        cache = out.past_key_values
        repeats = torch.full((ids.shape[0],), n) if isinstance(n, int) else torch.tensor(n)  # [b]
        source = torch.arange(ids.shape[0]).repeat_interleave(repeats).to(device)  # [N]: each sample's prompt
        cache.batch_select_indices(source)
        logits = out.logits[:, -1][source]  # [N, V]
        mask = mask[source]  # [N, Lp]
        rows: list[list[int]] = [[] for _ in range(logits.shape[0])]
        logprobs: list[list[float]] = [[] for _ in rows] if not sampling.greedy else []
        alive = torch.arange(logits.shape[0])  # original row of each row still being decoded
        for step in range(sampling.max_new_tokens):
            if sampling.greedy:
                token = logits.argmax(dim=-1)  # [alive]
            else:
                weights = tempered_weights(logits, sampling.temperature)  # [alive, V]
                totals = weights.sum(dim=-1)  # [alive]: before top-p truncation
                uniforms = torch.rand(len(rows), generator=generator, dtype=torch.float64)[alive]
                token = draw(top_p_filter(weights, sampling.top_p), uniforms.to(device))
                for row, lp in zip(alive.tolist(), sampled_logprob(weights, totals, token).tolist(), strict=True):
                    logprobs[row].append(lp)
            for row, t in zip(alive.tolist(), token.tolist(), strict=True):
                rows[row].append(t)
            running = token != eos  # [alive]
            if step == sampling.max_new_tokens - 1 or not running.any():
                break
            if not running.all():  # finished rows leave the batch and the cache
                still = running.nonzero(as_tuple=True)[0]
                cache.batch_select_indices(still)
                alive, token, mask = alive[still.cpu()], token[still], mask[still]
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)  # [alive, Lp + step + 1]
            out = model(input_ids=token.unsqueeze(1), attention_mask=mask,
                        position_ids=mask.sum(dim=1, keepdim=True) - 1, past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
        return rows, logprobs

    def _transformers_generate(self, model: Any, ids: Tensor, mask: Tensor, n: int, sampling: Sampling,
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
            seqs = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        return [_until_eos(row, tok.eos_token_id) for row in seqs[:, ids.shape[1] :].cpu().tolist()]

    def generator_logprobs(self) -> list[list[float]] | None:
        """Per completion of the last `generate`, the generator's log-prob of each sampled token; None after a
        greedy call or with decode=generate."""
        return self._logprobs

    def sync_weights(self, model: Any) -> None:
        """The policy after an optimizer step: float32 samples with it directly; a copy is refreshed from it."""
        self.model = model
        if self._copy is not None:  # not made yet: it is made from this model on first use
            self._copy.refresh(model)

    def close(self) -> None:
        """Drop the generator copy, if any (the policy is the trainer's)."""
        self._copy = None


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
