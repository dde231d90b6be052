"""Generation backends (`backend=`): `hf` (transformers generate) and `vllm` (colocated vLLM).

`vllm` imports vLLM only when it is built, so listing and configuring it works without vLLM installed.
"""

from gpo.backends import hf, vllm  # noqa: F401
