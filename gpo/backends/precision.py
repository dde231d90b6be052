"""Rollout precision (`backend.precision`): what each backend runs on this machine, the generator copy that `hf`
samples with below float32, and the vLLM settings each precision maps to.

`hf` at float32 (and `auto`) generates with the policy itself, as before: no copy, nothing to sync. At bf16 or int8
it holds a copy of the policy (a LoRA adapter folded in through `gpo.models.plain_weights`) that `sync_weights`
refreshes after every optimizer step:
- bf16: every parameter cast to bfloat16 (`copy_` into the copy's bfloat16 tensors).
- int8: the Linear layers (LM head included) as torch's dynamically quantised ones: weights int8 per tensor,
  activations quantised per call from their own range; embeddings and norms stay float32. A refresh copies the
  float parameters and re-quantises each Linear weight with the observer `quantize_dynamic` uses, so a refreshed
  copy equals a freshly quantised one.
torch's own `torch.ao.quantization.quantize_dynamic` is used, not torchao's Int8DynamicActivationInt8WeightConfig:
with torch 2.13 on CPU, torchao 0.18's int8 Linear ran 7 to 20 times slower than float32 without torch.compile
(its CPU path has no fused int8 GEMM in eager mode), while torch's fbgemm/oneDNN dynamic Linear ran faster than
float32. torch is already a dependency, so int8 needs no extra.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from gpo.hardware import Machine
from gpo.models import has_adapter, plain_weights
from gpo.parallel import full_parameters

# Each backend's values of backend.precision (its config's Literal). `auto`: float32 for hf; for vLLM float32 on
# CPU and the policy's dtype on GPU.
HF_PRECISIONS = ("auto", "float32", "bf16", "int8")
VLLM_PRECISIONS = ("auto", "float32", "bf16", "fp16", "fp8")
POLICY_ITSELF = ("auto", "float32")  # hf precisions that generate with the training model itself


def runnable(backend: str, machine: Machine) -> tuple[str, ...]:
    """The precisions `backend` runs at full speed on `machine`, besides `auto` (bf16 may also run emulated:
    `emulated_bf16`)."""
    out = ["float32"] + (["bf16"] if machine.bf16 else [])
    if backend == "hf":
        return (*out, *(["int8"] if machine.dynamic_int8 else []))
    return (*out, *(["fp16", "fp8"] if machine.cuda else []))


def emulated_bf16(backend: str, machine: Machine) -> bool:
    """Whether `backend` runs bf16 on `machine` only emulated (slower than float32). vLLM takes no bf16 on a GPU
    without it (compute capability 8.0 on), so there it is refused instead."""
    return not machine.bf16 and machine.bf16_emulation and not (backend == "vllm" and machine.cuda)


def refusal(backend: str, precision: str, machine: Machine) -> str | None:
    """Why `backend` cannot generate at `precision` on `machine` (one line naming the key), or None when it can.
    bf16 runs where it is only emulated, slower (the run says so: gpo.preflight). Values outside the backend's
    choices never get here: the config's Literal refuses them when composing."""
    emulated = emulated_bf16(backend, machine)
    if precision == "auto" or precision in runnable(backend, machine) or (precision == "bf16" and emulated):
        return None
    device = "CUDA GPU" if machine.cuda else "CPU"
    if precision == "bf16" and machine.bf16_emulation:
        why = "vLLM runs bf16 only on GPUs with native bfloat16 support (compute capability 8.0 or newer)"
    elif precision == "bf16":
        why = f"this {device} cannot compute in bfloat16"
    elif precision == "int8" and machine.cuda:
        why = "int8 is torch's dynamic quantisation, which runs on CPU only"
    elif precision == "int8":
        why = ("int8 needs torch's dynamic quantisation (torch.ao.quantization.quantize_dynamic and a quantized "
               "engine such as x86 or fbgemm), which this torch build lacks: install a standard torch build "
               "(pip install torch)")
    else:  # fp16 / fp8 in vLLM on a CPU
        why = f"vLLM runs {precision} on CUDA GPUs only"
    runs = ", ".join([*runnable(backend, machine), *(["bf16 (emulated, slower)"] if emulated else [])])
    return f"backend.precision={precision}: {why}; backend={backend} runs {runs} on this machine."


def vllm_settings(precision: str, on_gpu: bool, policy_dtype: torch.dtype) -> dict[str, Any]:
    """vLLM's `dtype` and `quantization` for a precision. fp8 is vLLM's online quantisation (weights cast to fp8
    when loaded, activations scaled per call), over bfloat16. `auto` reaches here only where the config did not
    resolve it to bf16 (gpo.config): float32 on CPU, the policy's dtype on GPU."""
    if precision == "auto":
        dtype = str(policy_dtype).removeprefix("torch.") if on_gpu else "float32"
        return {"dtype": dtype, "quantization": None}
    dtypes = {"float32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
    return {"dtype": dtypes[precision], "quantization": "fp8" if precision == "fp8" else None}


class GeneratorCopy:
    """The policy's weights at a generator precision (bf16 or int8), refreshed in place by `refresh`."""

    def __init__(self, policy: Any, precision: str) -> None:
        if precision not in ("bf16", "int8"):
            raise ValueError(f"a generator copy is bf16 or int8, not {precision}")
        self.precision = precision
        base = policy.get_base_model() if has_adapter(policy) else policy
        with full_parameters(policy):
            device = next(policy.parameters()).device
            # The class's own constructor: transformers' from_config would partition the copy under ZeRO-3.
            model = type(base)(base.config)
            model.to(device=device, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
            model.eval().requires_grad_(False)
            names = {n for n, _ in model.named_parameters()}
            self.model = model
            loaded, _ = self._copy_floats(policy, skip=set(), retain=set())
        if loaded != names:
            raise ValueError(f"the generator copy's parameters differ from the policy's: missing "
                             f"{sorted(names - loaded)[:3]}, unexpected {sorted(loaded - names)[:3]}")
        # Each Linear's weight and bias by their parameter names (a tied LM head names the embeddings), read
        # again at every refresh: after quantisation the Linear holds packed int8 data, no parameters.
        self.quantized: dict[str, tuple[str, str | None]] = {}
        if precision == "int8":
            canonical = {id(p): n for n, p in model.named_parameters()}
            self.quantized = {
                name: (canonical[id(m.weight)], canonical[id(m.bias)] if m.bias is not None else None)
                for name, m in model.named_modules() if type(m) is nn.Linear
            }
            with _quiet_quantization():
                torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)

    @torch.no_grad()
    def refresh(self, policy: Any) -> None:
        """Copy the policy's current weights in: a cast for float tensors, re-quantisation for int8 Linears.
        Collective under ZeRO-3 (the policy's full tensors are gathered for the duration)."""
        with full_parameters(policy):
            quantized_names = {n for pair in self.quantized.values() for n in pair if n is not None}
            _, weights = self._copy_floats(policy, skip=set(self.quantized), retain=quantized_names)
            with _quiet_quantization():
                for name, (weight, bias) in self.quantized.items():
                    module: Any = self.model.get_submodule(name)
                    module.set_weight_bias(quantize_weight(weights[weight]),
                                           None if bias is None else weights[bias].float())
            del weights  # views of gathered full tensors must not outlive the gathering

    def _copy_floats(self, policy: Any, skip: set[str],
                     retain: set[str]) -> tuple[set[str], dict[str, torch.Tensor]]:
        """Copy every plain weight of the policy into the copy, except those of the modules in `skip`; return the
        names copied and the tensors named in `retain` (the quantised Linears' sources)."""
        copied: set[str] = set()
        retained: dict[str, torch.Tensor] = {}
        for name, tensor in plain_weights(policy):
            module_name, _, attr = name.rpartition(".")
            if name in retain:
                retained[name] = tensor
            if module_name in skip:
                continue
            getattr(self.model.get_submodule(module_name), attr).copy_(tensor)
            copied.add(name)
        return copied, retained


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """A Linear weight as `quantize_dynamic` stores it: qint8 per tensor, symmetric, scale max|w| / 127.5 (the
    observer of torch's default dynamic qconfig)."""
    observer = torch.ao.quantization.default_dynamic_qconfig.weight()
    observer(weight.float())
    scale, zero_point = observer.calculate_qparams()
    return torch.quantize_per_tensor(weight.float(), float(scale), int(zero_point), torch.qint8)


@contextmanager
def _quiet_quantization() -> Iterator[None]:
    """torch marks its eager quantisation API deprecated in favour of torchao, slower here (module docstring)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(deprecat|quantiz).*", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        yield
