"""From questions to a RolloutBatch: chat-template the prompts, generate completions through a backend, build masks."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gpo.errors import UserError
from gpo.types import Backend, Messages, RolloutBatch, Sampling


def encode_prompts(tokenizer: Any, conversations: list[Messages], max_prompt_length: int,
                   tools: list[dict] | None = None) -> list[list[int]]:
    """Token ids of each conversation with the generation prompt; over-long prompts keep their last tokens. `tools`
    (JSON schemas) go to a chat template that renders them (gpo/agent.py).

    Chat templates without a system role (Gemma 2, older Mistral) raise on a system message; the system text must
    still reach the model, so it is folded into the first user turn, as those models' own recipes do.
    """
    from jinja2 import TemplateError

    from gpo.errors import UserError

    encoded = []
    for messages in conversations:
        try:
            ids = _chat_template_ids(tokenizer, messages, tools)
        except TemplateError as exc:
            folded = fold_system_message(messages)
            if folded == messages:
                raise UserError(f"the tokenizer's chat template rejects the task's prompt: {exc}") from exc
            try:
                ids = _chat_template_ids(tokenizer, folded, tools)
            except TemplateError as again:
                raise UserError(f"the tokenizer's chat template rejects the task's prompt, even with the system "
                                f"message folded into the first user turn: {again}") from again
        encoded.append(list(ids[-max_prompt_length:]))
    return encoded


def fold_system_message(messages: Messages) -> Messages:
    """The conversation with a leading system message prepended to the first user turn (a blank line between)."""
    if not messages or messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], list(messages[1:])
    for i, turn in enumerate(rest):
        if turn["role"] == "user":
            rest[i] = {**turn, "content": f"{system}\n\n{turn['content']}"}
            return rest
    return [{"role": "user", "content": system}, *rest]


def _chat_template_ids(tokenizer: Any, messages: Messages, tools: list[dict] | None = None) -> list[int]:
    extra = {} if tools is None else {"tools": tools}  # a custom tokenizer's template may not take `tools`
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def decode_completions(tokenizer: Any, completions: list[list[int]]) -> list[str]:
    """The text of each completion, decoded from its own generated tokens only.

    The one decoding used for rewards, evaluation records and logged completions. Never decode a padded or
    mask-multiplied matrix: in the Qwen2.5, Llama-3 and GPT-2 vocabularies id 0 (and often the pad id) is an
    ordinary token such as `!`, so padding would reach the reward function as text after a shorter completion.
    """
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in completions]


def completion_tokens(batch: RolloutBatch) -> list[list[int]]:
    """Each row's generated tokens (up to and including EOS), without the padding of the batch matrix."""
    lengths = batch.lengths.tolist()
    return [row[:n] for row, n in zip(batch.completion_ids.tolist(), lengths, strict=True)]


def completion_mask(completions: Tensor, eos_token_id: int, lengths: Tensor) -> Tensor:
    """1 on tokens up to and including the first EOS; rows without EOS keep every generated token."""
    L = completions.shape[1]
    is_eos = completions == eos_token_id  # [N, L]
    first_eos = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full_like(lengths, L))
    end = torch.minimum(first_eos + 1, lengths)  # [N]
    return (torch.arange(L).unsqueeze(0) < end.unsqueeze(1)).long()  # [N, L]


def pad(rows: list[list[int]], value: int, left: bool) -> tuple[Tensor, Tensor]:
    width = max((len(r) for r in rows), default=0) or 1
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            sl = slice(width - len(r), width) if left else slice(0, len(r))
            ids[i, sl] = torch.tensor(r, dtype=torch.long)
            mask[i, sl] = 1
    return ids, mask


def counts_per_prompt(n: int | list[int], prompts: int) -> list[int]:
    """A backend's `n` argument (one count for every prompt, or one per prompt) as one count per prompt."""
    return [n] * prompts if isinstance(n, int) else list(n)


def generate(backend: Backend, prompts: list[list[int]], n: int | list[int], sampling: Sampling, seed: int,
             eos_token_id: int, pad_token_id: int, rank: int = 0) -> RolloutBatch:
    """n completions per prompt (or n[i] for prompt i, from a backend with `per_prompt_counts`) as a batch with zero
    rewards/advantages (filled in by the engine); rows are prompt-major."""
    counts = counts_per_prompt(n, len(prompts))
    completions = backend.generate(prompts, n, sampling, seed)  # N lists of token ids, prompt-major
    if len(completions) != sum(counts):
        raise UserError(f"backend {type(backend).__name__} returned {len(completions)} completions for the "
                        f"{sum(counts)} asked ({len(prompts)} prompts); `generate` must return n per prompt.")
    repeated = [p for p, c in zip(prompts, counts, strict=True) for _ in range(c)]
    prompt_ids, prompt_mask = pad(repeated, pad_token_id, left=True)  # [N, Lp]
    completion_ids, generated = pad(completions, pad_token_id, left=False)  # [N, L]
    lengths = generated.sum(dim=1)
    mask = completion_mask(completion_ids, eos_token_id, lengths)  # [N, L]
    reported = backend.generator_logprobs()
    generator_logprobs = None if reported is None else pad_floats(reported, completion_ids.shape[1])  # [N, L]
    has_eos = ((completion_ids == eos_token_id) & (generated > 0)).any(dim=1)
    N = len(completions)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=mask,
        group_ids=torch.arange(len(prompts)).repeat_interleave(torch.tensor(counts, dtype=torch.long)),  # [N]
        rewards=torch.zeros(N),
        advantages=torch.zeros(N),
        truncated=~has_eos,
        owner_rank=torch.full((N,), rank, dtype=torch.long),
        generator_logprobs=generator_logprobs,
    ).trimmed()


def pad_floats(rows: list[list[float]], width: int) -> Tensor:
    """Per-token floats right-padded with 0 to `width` columns: [len(rows), width] float32."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out
