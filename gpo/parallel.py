"""Per-process wiring to Accelerate and DeepSpeed: the Accelerator, gradient accumulation, the reference model,
generation and saving under ZeRO-3.

The engine stays strategy-blind: it asks this module for an Accelerator, accumulates micro-batches through
`accumulating`, generates inside `gathered`, and saves `full_state_dict`. What differs between plain DDP and
DeepSpeed ZeRO-2/3 lives here:

- Gradient accumulation. Accelerate's DeepSpeed wrapper runs `engine.step()` (clip + optimizer step + zero grad)
  inside every `accelerator.backward` while `sync_gradients` is true, and `accelerator.no_sync` does nothing
  under ZeRO >= 2. The engine loops micro-batches itself, so `accumulating` lowers `sync_gradients` for all but
  the last micro-batch: DeepSpeed then accumulates and steps exactly once per optimizer step, clipping with
  `gradient_clipping` = optim.max_grad_norm (its `optimizer.step()` / `zero_grad()` wrappers are no-ops).
- ZeRO-3 partitions every parameter. `TokenLogprobs` reads the output head's weight directly (not through the
  head's forward), so that weight is registered as an external parameter of the wrapper, which makes DeepSpeed
  gather it for the wrapper's forward and backward. `generate` runs many small forwards: all parameters are
  gathered once for the whole call instead of layer by layer per token.
- The reference model under ZeRO-3 is sharded too, as an inference-only DeepSpeed engine: with zero.Init active
  (Accelerate turns it on for ZeRO-3), `from_pretrained` already partitions it at load time, and a second full
  copy per rank is exactly the memory ZeRO-3 is chosen to save. Under DDP and ZeRO-2 parameters are replicated
  anyway, so the reference stays a plain frozen model in eval mode on each rank's device.
- A generator with its own copy of the weights (backend=vllm) is synced from full tensors: `full_parameters`
  gathers the partitioned policy collectively for the sync, as `gathered` does for generation.

DeepSpeed is imported only where engine.deepspeed_stage > 0 needs it: importing it costs seconds and prints its
accelerator warning (on CPU). Accelerate would otherwise import it in every single-process run that unwraps or
saves a model (see `defer_deepspeed_import`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gpo.errors import UserError
from gpo.hardware import mixed_precision
from gpo.run_config import EngineConfig, OptimConfig, TrainConfig


def deepspeed_config(engine: EngineConfig, train: TrainConfig, optim: OptimConfig, world_size: int) -> dict:
    """The DeepSpeed config for engine.deepspeed_stage. DeepSpeed insists on consistent batch sizes although the
    engine drives accumulation itself: one micro-batch per DeepSpeed step, boundaries set by `accumulating`."""
    zero: dict[str, Any] = {"stage": engine.deepspeed_stage}
    if engine.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if engine.deepspeed_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    if engine.deepspeed_stage == 3:
        # save_model gathers the full weights through accelerator.get_state_dict.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    precision = mixed_precision(engine.mixed_precision)
    return {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": train.micro_batch_size * world_size,
        "gradient_clipping": optim.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        # gpo's own AdamW (torch) as the client optimizer, also when the optimizer state is offloaded.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # gpo logs its own metrics
    }


def defer_deepspeed_import() -> None:
    """Stop Accelerate importing DeepSpeed just to ask whether a model is wrapped in a DeepSpeedEngine.

    `accelerate.utils.extract_model_from_parallel` (behind `Accelerator.unwrap_model` and transformers'
    `save_pretrained`) imports `deepspeed` whenever it is installed, for an isinstance check. No object can be a
    DeepSpeedEngine before `deepspeed` is imported, so asking `sys.modules` instead answers that check exactly,
    and single-process runs never import it. Idempotent; once DeepSpeed is imported the check is Accelerate's own.
    """
    try:
        from accelerate.utils import other
    except ImportError:
        return
    if hasattr(other, "is_deepspeed_available"):  # a later Accelerate that no longer has it needs nothing here
        other.is_deepspeed_available = _deepspeed_imported


def _deepspeed_imported() -> bool:
    return "deepspeed" in sys.modules


def _import_deepspeed() -> None:
    """DeepSpeed's autotuner imports mlflow whenever it is installed (seconds of every ZeRO rank's start, pandas
    included), only to log autotuning trials, which gpo never runs. Unless mlflow is imported already (gpo's
    tracking then uses it), that one import sees it as missing; later imports of mlflow find it as usual."""
    hide = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed  # noqa: F401
    finally:
        if hide and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]


def build_accelerator(engine: EngineConfig, train: TrainConfig, optim: OptimConfig) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    defer_deepspeed_import()
    # Accelerate keeps one precision per process and refuses a second Accelerator that asks for another: clear it
    # (the process group and rank layout, PartialState, stay) so engines built one after another in one process
    # (a notebook, the benchmarks' arms) each train in their own engine.mixed_precision.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)

    # An EngineConfig built by hand (not composed) may still say `auto`: resolved here for Accelerate as well.
    engine = dataclasses.replace(engine, mixed_precision=mixed_precision(engine.mixed_precision))
    cpu = not torch.cuda.is_available()  # stage, precision and offload are checked when composing (EngineConfig)
    # A peer that hangs fails the others' next collective after this long instead of torch's 30 minutes.
    timeout = datetime.timedelta(seconds=engine.collective_timeout_s)
    timeouts = [InitProcessGroupKwargs(timeout=timeout)]
    if engine.deepspeed_stage == 0:
        return Accelerator(mixed_precision=engine.mixed_precision, cpu=cpu, kwargs_handlers=timeouts)
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed looks for CUDA otherwise
    try:
        _import_deepspeed()
    except ImportError:
        raise UserError("engine.deepspeed_stage > 0 needs DeepSpeed: pip install 'gpo[deepspeed]'.") from None
    from accelerate.utils import DeepSpeedPlugin

    # Under a DeepSpeed launch on CPU Accelerate's own process count reads 1 (see _count_ranks): use WORLD_SIZE.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(engine, train, optim, world_size),
                             zero3_init_flag=engine.deepspeed_stage == 3)
    accelerator = Accelerator(mixed_precision=engine.mixed_precision, deepspeed_plugin=plugin,
                              kwargs_handlers=timeouts)
    if cpu:
        _count_ranks(accelerator, timeout)
    return accelerator


def _count_ranks(accelerator: Any, timeout: datetime.timedelta) -> None:
    """Accelerate 1.15 finds no distributed backend for DeepSpeed without a GPU and records one process of index
    0 on every rank (so every rank was 'main' and wrote checkpoints and models), while DeepSpeed itself has
    started the gloo group. Copy the group's real layout into Accelerate's process state."""
    import torch.distributed as dist
    from accelerate import PartialState

    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    for state in (PartialState(), accelerator.state):  # AcceleratorState holds a copy of PartialState's fields
        state.num_processes, state.process_index = dist.get_world_size(), dist.get_rank()
        state.local_process_index = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    assert accelerator.num_processes == dist.get_world_size()  # the Accelerator reads the shared state


def zero3(accelerator: Any) -> bool:
    """Whether ZeRO-3 partitions the weights (never without an accelerator: a generator process has none)."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def prepare_policy(accelerator: Any, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """accelerator.prepare, after telling ZeRO-3 that the log-prob wrapper uses the head's weight directly."""
    if zero3(accelerator):
        _register_head(module)
    return accelerator.prepare(module, optimizer)


def prepare_reference(accelerator: Any, module: nn.Module) -> Any:
    """The frozen reference log-prob module: sharded as an inference engine under ZeRO-3, else on the device."""
    if not zero3(accelerator):
        return module.to(accelerator.device).eval()
    import deepspeed

    _register_head(module)
    config = {k: v for k, v in accelerator.state.deepspeed_plugin.deepspeed_config.items()
              if k in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                       "zero_optimization", "bf16", "fp16")}
    config["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items() if k != "offload_optimizer"}
    engine, *_ = deepspeed.initialize(model=module, config=config)
    engine.eval()  # DeepSpeedEngine.eval returns None, unlike nn.Module.eval
    return engine


@contextlib.contextmanager
def accumulating(accelerator: Any, module: Any, last: bool) -> Iterator[None]:
    """One micro-batch's forward and backward; gradients are reduced and the optimizer steps only when `last`."""
    if accelerator.state.deepspeed_plugin is None:
        with contextlib.nullcontext() if last else accelerator.no_sync(module):
            yield
        return
    # DeepSpeed: Accelerate's backward sets the accumulation boundary and steps from `sync_gradients`.
    accelerator.gradient_state._set_sync_gradients(last)
    try:
        yield
    finally:
        accelerator.gradient_state._set_sync_gradients(True)


@contextlib.contextmanager
def gathered(accelerator: Any, model: nn.Module, needed: bool = True) -> Iterator[None]:
    """Full parameters for the duration (ZeRO-3 generation and evaluation); nothing to do otherwise.

    `needed=backend.generates_with_policy`: a generator with its own weights (vLLM) runs no forward of the policy
    while it generates, so nothing is gathered for it (it gathers for its weight sync through `full_parameters`).
    """
    if not needed or not zero3(accelerator):
        yield
        return
    with full_parameters(model):
        yield


@contextlib.contextmanager
def full_parameters(model: nn.Module) -> Iterator[None]:
    """The full tensors of a model that ZeRO-3 partitions, for the duration; nothing to do for any other model.

    Collective: every rank must enter it together. Parameters already gathered (inside `gathered`) are left alone,
    so nesting is safe: an inner GatheredParameters over them would partition them again on exit, under the outer.
    Needs no Accelerator: the vLLM backend calls it on the policy it holds when it syncs weights.
    """
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]  # set by deepspeed.zero.Init
    if partitioned:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        status = ZeroParamStatus.NOT_AVAILABLE
        partitioned = [p for p in partitioned if p.ds_status == status]  # type: ignore[attr-defined]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned):
        yield


def full_state_dict(accelerator: Any, module: Any) -> dict[str, torch.Tensor] | None:
    """The policy's full weights (keys as `save_pretrained` writes them). Every rank must call it: ZeRO-3 gathers
    the shards collectively. None where nothing differs from the model's own state (DDP, ZeRO-2)."""
    if accelerator.state.deepspeed_plugin is None or not zero3(accelerator):
        return None
    state = accelerator.get_state_dict(module)
    prefix = "model."  # TokenLogprobs keeps the causal LM as `.model`
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)} if state else state


def _register_head(module: Any) -> None:  # a TokenLogprobs: the causal LM is its `.model`
    import deepspeed

    deepspeed.zero.register_external_parameter(module, module.model.get_output_embeddings().weight)
