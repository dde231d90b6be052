"""Generation backends (`backend=`): `hf` (transformers generate) and `vllm` (colocated vLLM)."""
