"""Per-token log-probabilities of completions, without full-vocabulary float32 logits for a whole batch.

The decoder runs over prompt+completion; the LM head and log-softmax then run over chunks of at most
`chunk_size` positions, each chunk re-computed in the backward pass (activation checkpointing), so peak memory
holds one chunk of [chunk, V] logits instead of [n, L, V].

Prompt sharing: the G completions of a question share one prompt, and on short-answer tasks the prompt is most of
each row (arith: ~60 prompt tokens, 20-30 completion tokens). When a micro-batch holds several rows of one prompt,
the decoder runs once over each distinct prompt, its keys/values are expanded to that prompt's rows, and a
second pass runs over the completions alone, attending to them. The result is the same function (tested against
the full forward, values and gradients); gradients flow back through the expansion into the shared prompt pass.

`TokenLogprobs` is an nn.Module so that Accelerate/DeepSpeed can wrap it: its forward is the training forward,
and gradients flow through the wrapper's hooks (calling a wrapped model's sub-modules directly would bypass them).

Mixed precision (docs/precision.md): with `precision` bf16 or fp16 the decoder runs under torch.autocast, so its
matrix products take 16-bit copies of the float32 weights and gradients come back float32. The LM head and the
log-softmax never run under autocast: they compute in the stored weights' dtype (float32 master weights) and then
float32, because rounding logits of magnitude ~20 to bf16 (step 0.125) is the largest single error in a log-prob.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gpo.types import RolloutBatch

# engine.mixed_precision's values -> the autocast dtype ("no": no autocast, the parameters' own dtype).
AUTOCAST_DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as transformers' generate computes them (so log-probs agree)."""
    positions = attention_mask.long().cumsum(dim=-1) - 1  # [n, T]
    return positions.clamp(min=0)


class TokenLogprobs(nn.Module):
    """logp[i, t] = log softmax(lm_head(h) / temperature)[completion_ids[i, t]] for the completion positions."""

    def __init__(self, model: nn.Module, chunk_size: int = 1024, share_prompt: bool = True,
                 precision: str = "no") -> None:
        super().__init__()
        # Any: a transformers (or peft) causal LM; as an nn.Module mypy would type its get_decoder() and
        # get_output_embeddings() as Tensor | Module attributes (torch's __getattr__).
        self.model: Any = model
        self.chunk_size = chunk_size
        self.share_prompt = share_prompt
        # The decoder's autocast (a key of AUTOCAST_DTYPES). Entered inside forward, so it also overrides the
        # autocast Accelerate wraps a prepared module's forward in; `computing_in` switches it for a no-grad pass.
        self.precision = precision

    @property
    def share_prompt(self) -> bool:
        return self._share_prompt

    @share_prompt.setter
    def share_prompt(self, on: bool) -> None:
        """Asked-for sharing holds only where it is exact for the model (see `supports_prompt_sharing`)."""
        self._share_prompt = on and supports_prompt_sharing(self.model)

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                temperature: float = 1.0, with_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """logp [n, L]; with `with_entropy` also (logp, entropy [n, L]): each position's entropy of
        softmax(logits / temperature), detached, from the same chunk of logits (no second LM head pass)."""
        dtype = AUTOCAST_DTYPES[self.precision]
        with torch.autocast(prompt_ids.device.type, dtype=dtype, enabled=dtype is not None):
            logp, entropy = self._logprobs(prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                                           with_entropy)
        return (logp, entropy) if with_entropy else logp

    def _logprobs(self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                  temperature: float, with_entropy: bool = False) -> tuple[Tensor, Tensor]:
        prompts = distinct_prompts(prompt_ids, prompt_mask) if self.share_prompt else None
        if prompts is not None and len(prompts[0]) < len(prompt_ids):
            h = self._hidden_shared(prompt_ids, prompt_mask, completion_ids, completion_mask, *prompts)
        else:
            h = self._hidden_full(prompt_ids, prompt_mask, completion_ids, completion_mask)
        head = self.model.get_output_embeddings()
        flat_h = h.reshape(-1, h.shape[-1])  # [n*L, H]
        flat_ids = completion_ids.reshape(-1)  # [n*L]
        parts, entropies = [], []
        for lo in range(0, flat_h.shape[0], self.chunk_size):
            # A fresh list per chunk: the first call fills it, so the backward pass's replay of the chunk skips the
            # entropy (it only needs the log-probs' saved tensors, and the replay's outputs are discarded).
            args = (flat_h[lo : lo + self.chunk_size], flat_ids[lo : lo + self.chunk_size], head.weight,
                    head.bias, temperature, [with_entropy])
            if torch.is_grad_enabled():
                logp, entropy = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
            else:
                logp, entropy = _chunk_logprobs(*args)
            parts.append(logp)
            entropies.append(entropy)
        # Without `with_entropy` the entropy chunks are empty and this is an empty tensor nobody reads.
        return torch.cat(parts).view(completion_ids.shape), torch.cat(entropies)  # [n, L], [n*L] or [0]

    def _hidden_full(self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                     completion_mask: Tensor) -> Tensor:
        """[n, L, H]: the state before each completion token, from one pass over prompt+completion per row."""
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [n, Lp + L]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        # Padding after EOS is masked out of the loss anyway; attending to it would only change padded positions.
        hidden = self.model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask), use_cache=False,
        ).last_hidden_state  # [n, Lp + L, H]
        start = prompt_ids.shape[1] - 1  # the state before completion token t predicts token t
        return hidden[:, start : start + completion_ids.shape[1]]

    def _hidden_shared(self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                       completion_mask: Tensor, first: Tensor, owner: Tensor) -> Tensor:
        """[n, L, H] as `_hidden_full`, with one decoder pass per distinct prompt (rows `first`, shared by the rows
        that `owner` maps to it) and one over the completions, attending to the expanded prompt keys/values."""
        from transformers.cache_utils import Cache

        decoder = self.model.get_decoder()
        # Under gradient checkpointing the layers would turn `use_cache` off (with a warning) and keep the cache
        # only through `_cache_survives_checkpointing`; ask for it only where it is honoured as asked.
        checkpointing = bool(getattr(self.model, "is_gradient_checkpointing", False))
        RecordingLayer, PrefixLayer = _cache_layers()
        recorded = Cache(layer_class_to_replicate=RecordingLayer)
        shared_mask = prompt_mask[first]  # [u, Lp]
        with _cache_survives_checkpointing(decoder, checkpointing):
            prompt_hidden = decoder(
                input_ids=prompt_ids[first], attention_mask=shared_mask,
                position_ids=position_ids_from_mask(shared_mask), past_key_values=recorded,
                use_cache=not checkpointing,
            ).last_hidden_state  # [u, Lp, H]
            # Cache.layers are the RecordingLayers the prompt pass above filled.
            prefix = Cache(layers=[PrefixLayer(layer.keys[owner], layer.values[owner])
                                   for layer in recorded.layers])
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # [n, Lp + L]
            completion_hidden = decoder(
                input_ids=completion_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask)[:, prompt_ids.shape[1]:],
                past_key_values=prefix, use_cache=not checkpointing,
            ).last_hidden_state  # [n, L, H]
        # The last prompt state predicts completion token 0; completion state t predicts token t + 1.
        return torch.cat([prompt_hidden[owner, -1:], completion_hidden[:, :-1]], dim=1)


def _chunk_logprobs(h: Tensor, ids: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
                    entropy_wanted: list[bool]) -> tuple[Tensor, Tensor]:
    """(log softmax(h W^T + b) / temperature at `ids` [c], entropy [c] or empty): the head in the weights' own dtype
    (never autocast: see the module header), the log-softmax in float32. Weights stored in bf16 (DeepSpeed bf16)
    give bf16 logits, upcast. The entropy is computed without gradient, so backward keeps nothing extra for it;
    `entropy_wanted` [flag] is cleared once it is computed, so a checkpoint replay does not compute it again."""
    with torch.autocast(h.device.type, enabled=False):
        logits = nn.functional.linear(h.to(weight.dtype), weight, bias).float() / temperature  # [c, V], one chunk
    log_probs = logits.log_softmax(dim=-1)  # [c, V]
    logp = log_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [c]
    if not entropy_wanted[0]:
        return logp, logp.new_empty(0)
    entropy_wanted[0] = False
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)  # [c]
    return logp, entropy


def micro_batches(batch: RolloutBatch, size: int) -> Iterator[RolloutBatch]:
    """Consecutive slices of `size` rows, each re-trimmed to its own longest completion."""
    for lo in range(0, len(batch), size):
        yield batch.select(torch.arange(lo, min(lo + size, len(batch))))


@contextmanager
def computing_in(module: TokenLogprobs, precision: str) -> Iterator[None]:
    """`module` runs under `precision` (a key of AUTOCAST_DTYPES) for the duration: a no-grad pass of the policy
    in another precision than its training passes (engine.logprob_precision)."""
    before, module.precision = module.precision, precision
    try:
        yield
    finally:
        module.precision = before


@torch.no_grad()
def batch_logprobs(module: Any, batch: RolloutBatch, micro_batch_size: int, temperature: float) -> Tensor:
    """[N, L] log-probs for every row of `batch` (old-policy or reference pass), padded to the batch's width."""
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
    row = 0
    for mb in micro_batches(batch, micro_batch_size):
        logp = module(mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.attended, temperature)
        out[row : row + len(mb), : logp.shape[1]] = logp.float().cpu()
        row += len(mb)
    return out


def supports_prompt_sharing(model: Any) -> bool:  # any object: what is not a supported causal LM answers False
    """Whether the shared-prompt pass is exact for this model: transformers' layered cache API is present and every
    layer attends to the whole context (a sliding-window layer would see a different window through a cache)."""
    try:
        from transformers.cache_utils import Cache, DynamicLayer  # noqa: F401  (layered caches: transformers >= 4.56)
    except ImportError:
        return False
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_decoder"):
        return False
    if getattr(model, "is_gradient_checkpointing", False):
        from transformers.modeling_layers import GradientCheckpointingLayer

        if not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache") or not _checkpointed_layers(
            model.get_decoder()
        ):
            return False  # a checkpointing scheme that would drop or double-append the cache
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False


def distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(first, owner): one representative row per distinct (ids, mask) prompt, and for each row the index into
    `first` of its prompt, so that prompt_ids[first][owner] == prompt_ids."""
    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # [n, 2 Lp]
    _, owner = torch.unique(keys, dim=0, return_inverse=True)  # [n] into the u distinct prompts
    first = torch.empty(int(owner.max()) + 1, dtype=torch.long, device=owner.device)
    first.scatter_(0, owner, torch.arange(len(owner), device=owner.device))  # any row of each prompt will do
    return first, owner


@functools.cache
def _cache_layers() -> tuple[type, type]:
    """The two cache layers of the shared-prompt pass (built on first use: importing transformers is slow)."""
    from transformers.cache_utils import DynamicLayer

    class RecordingLayer(DynamicLayer):
        """Prompt pass: keeps this pass's keys/values. It overwrites instead of appending, so the replay of a
        gradient-checkpointed layer in the backward pass computes the same shapes and leaves no trace."""

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            return key_states, value_states

    class PrefixLayer(DynamicLayer):
        """Completion pass: attends to a fixed prefix and never grows (same reason: replays see the same keys)."""

        keys: Tensor  # set at construction (DynamicLayer's may be None before its first update)
        values: Tensor

        def __init__(self, keys: Tensor, values: Tensor) -> None:
            super().__init__()
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    return RecordingLayer, PrefixLayer


@contextmanager
def _cache_survives_checkpointing(decoder: nn.Module, checkpointing: bool) -> Iterator[None]:
    """transformers drops `past_key_values` inside gradient-checkpointed layers, since the backward replay of a
    layer would append to an ordinary cache a second time. Both caches above are replay-safe, so let them through."""
    if not checkpointing:
        yield
        return
    layers = _checkpointed_layers(decoder)
    for layer in layers:
        # An instance attribute, shadowing the class's False (nn.Module.__setattr__ is typed for tensors and modules
        # only; any other value is stored as a plain attribute).
        layer._can_checkpoint_with_cache = True  # type: ignore[assignment]
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


def _checkpointed_layers(decoder: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]
