"""Generation backends (`backend=`): `hf` (transformers generate) and `vllm` (colocated vLLM)."""

from gpo.backends import hf  # noqa: F401
