"""One way from a run config to a run's parts: `build_parts(cfg)` is what the engine, `gpo eval`, `gpo study` and
the benchmarks use, so a component is constructed with the same context everywhere (each by `gpo.registry.build`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpo import registry
from gpo.agent import Agent, build_agent
from gpo.run_config import RunConfig
from gpo.types import Allocator, Backend, Correction, Objective, Pruner, Selector, Task, Tracker


@dataclass
class Parts:
    """A run's parts: its components, tokenizer, models and backend. `reference` is the frozen KL model, loaded only
    when the objective has a KL term."""

    objective: Objective
    selector: Selector
    pruner: Pruner
    allocator: Allocator
    task: Task
    tracker: Tracker
    tokenizer: Any
    policy: Any
    reference: Any
    backend: Backend
    correction: Correction
    agent: Agent | None = None  # the task's tools and environment (gpo/agent.py); None: single-turn rollouts

    def close(self) -> None:
        """Free what the parts hold outside Python (a generator's process group, a task's and the tools' worker
        processes)."""
        for part in (self.backend, self.task, self.agent):
            if part is not None:
                part.close()


def build_parts(cfg: RunConfig, run_dir: Path | None = None, rank: int = 0, trainable: bool = True,
                policy: Any = None) -> Parts:
    """Every part of a run: components, tokenizer, policy (trainable unless evaluating), reference, backend; the
    tracker only on rank 0 with a run directory (a null one otherwise). A given `policy` is used as it is instead
    of loading one (the async generator builds its parts around its own copy).

    Under ZeRO-3 the accelerator must exist first (models are then loaded partitioned); the engine builds it and
    then calls this."""
    from gpo.models import load_policy, load_tokenizer
    from gpo.tracking import NullTracker

    # Model-free parts first: a setting only a constructor can check fails before any model loads.
    objective = registry.build(cfg.algo, max_completion_length=cfg.train.max_completion_length)
    selector, pruner = registry.build(cfg.selector), registry.build(cfg.pruner)
    allocator, task = registry.build(cfg.allocator), registry.build(cfg.task)
    correction = registry.build(cfg.correction)
    agent = build_agent(cfg.task.config)
    tracker = registry.build(cfg.tracker, run_dir=str(run_dir)) if rank == 0 and run_dir is not None else NullTracker()
    tokenizer = load_tokenizer(cfg.model)
    if policy is None:
        policy = load_policy(cfg.model, trainable=trainable)
    reference = load_policy(cfg.model, trainable=False) if trainable and objective.needs_ref_logprobs else None
    backend = registry.build(cfg.backend, model=policy, tokenizer=tokenizer)
    return Parts(objective, selector, pruner, allocator, task, tracker, tokenizer, policy, reference, backend,
                 correction, agent)
