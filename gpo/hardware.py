"""What this machine computes natively (CUDA, bfloat16, torch's dynamic int8), and what the `auto` precisions
resolve to on it: engine.mixed_precision and backend.precision default to `auto`, which is bf16 where the machine
has bfloat16 instructions and the weights load in float32, float32 elsewhere (docs/precision.md gives the
measurements behind it). `GPO_AUTO_PRECISION=float32|bf16` pins `auto` on every machine. A bf16 asked for
explicitly runs wherever bfloat16 computes at all, emulated where the machine lacks it (slower: `slow_bf16`)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Literal, cast

import torch

from gpo.errors import UserError

AUTO_PRECISION_ENV = "GPO_AUTO_PRECISION"


@dataclass(frozen=True)
class Machine:
    """What the device generation and training run on can do."""

    cuda: bool
    bf16: bool  # native bfloat16 matmuls: a CUDA GPU that supports them, or a CPU oneDNN runs them natively on
    dynamic_int8: bool  # torch's dynamic int8 Linear: CPU only, a quantized engine in this torch build
    # bf16 instructions of their own (x86: AVX-512 BF16 or AMX): where the `auto` precisions pick bf16. Plain
    # AVX-512 runs bf16 through conversions, with no measured gain over float32.
    bf16_instructions: bool = False
    # bfloat16 computes at all, natively or emulated: every CPU (AVX2 emulates it, several times slower than
    # float32); a GPU where torch can emulate it when it lacks it.
    bf16_emulation: bool = True


def this_machine() -> Machine:
    cuda = torch.cuda.is_available()
    emulation = True
    if cuda:
        bf16 = instructions = _cuda_native_bf16()
        emulation = bool(torch.cuda.is_bf16_supported())
    else:  # AVX-512 (with or without its BF16 extension), AMX or Arm BF16; on AVX2 bfloat16 is emulated and slow
        bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
        instructions = bf16 and (not x86 or _cpu_has("_is_avx512_bf16_supported") or _cpu_has("_is_amx_tile_supported"))
    engines = set(torch.backends.quantized.supported_engines) - {"none"}
    int8 = not cuda and bool(engines) and hasattr(torch.ao.quantization, "quantize_dynamic")
    return Machine(cuda=cuda, bf16=bf16, dynamic_int8=int8, bf16_instructions=instructions, bf16_emulation=emulation)


def _cuda_native_bf16() -> bool:
    """bfloat16 in the GPU's own instructions (compute capability 8.0 on, or ROCm), not torch's emulation of it."""
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # a torch before the argument: it counted native support only
        return bool(torch.cuda.is_bf16_supported())


def slow_bf16(machine: Machine) -> str | None:
    """Why bf16 runs slowly on `machine` (emulated: it has no native bfloat16), or None where it is native."""
    if machine.bf16:
        return None
    device = "CUDA GPU" if machine.cuda else "CPU"
    return f"this {device} has no native bfloat16 support, so bf16 is emulated here and runs slower than float32"


def _cpu_has(probe: str) -> bool:
    """torch.cpu's feature probe `probe`, False where this torch lacks it."""
    return bool(getattr(torch.cpu, probe, lambda: False)())


def auto_precision(dtype: str = "float32") -> tuple[str, str]:
    """(bf16 or float32, why) for the `auto` precisions of a policy loaded in `dtype`; why is empty when the
    environment pins them."""
    if dtype != "float32":  # no float32 master weights to keep: the policy trains and samples in its own dtype
        return "float32", f"model.dtype={dtype}: the policy trains and samples in its own dtype"
    pinned = os.environ.get(AUTO_PRECISION_ENV, "").strip()
    if pinned:
        if pinned not in ("float32", "bf16"):
            raise UserError(f"{AUTO_PRECISION_ENV}={pinned}: it pins what the `auto` precisions mean, float32 or bf16 "
                            f"(unset: from this machine).")
        return pinned, ""
    machine = this_machine()
    device = "CUDA GPU" if machine.cuda else "CPU"
    if machine.bf16_instructions:
        return "bf16", f"this {device} multiplies bfloat16 natively; float32: engine.mixed_precision=no " \
                       f"backend.precision=float32"
    return "float32", f"this {device} has no bfloat16 instructions"


def mixed_precision(value: str, dtype: str = "float32") -> Literal["no", "bf16", "fp16"]:
    """engine.mixed_precision as Accelerate takes it: `auto` resolved for this machine, other values as they are.
    A composed config holds the resolved value already; an EngineConfig built by hand may still say `auto`."""
    if value != "auto":
        return cast(Literal["no", "bf16", "fp16"], value)
    return "bf16" if auto_precision(dtype)[0] == "bf16" else "no"
