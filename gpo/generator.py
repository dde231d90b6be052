"""The generator's side of train.max_staleness >= 1 (docs/async.md): the loop that produces steps ahead of the
trainer, wherever it runs (a spawned process, gpo/async_rollout.py; a Ray actor, gpo/async_ray.py).

It holds a private copy of the policy and its own rollout parts (task, selector, pruner, allocator, backend) and
produces whole steps, as `Lockstep` does in the engine's process: step j's phases up to its kept rows (plan, rounds,
rewards, score, prune, refill; docs/architecture.md, "The step"), sampled with the trainer's weights after
max(0, j - k) steps (version max(0, j - k)), or newer ones taken before each generation call with
train.weight_updates=inflight. The trainer runs the rest (shard, log-probs, update, metrics). It copies published
weights out of the channel's shared copy and tells the trainer which version it took, so the trainer never rewrites
weights the generator is still copying.
"""

from __future__ import annotations

import copy
import ctypes
import io
import os
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from gpo import registry
from gpo.build import build_parts
from gpo.distributed import peer_failures_explained
from gpo.errors import UserError
from gpo.metrics import PhaseTimer
from gpo.rollout import Produced, Rollout
from gpo.run_config import RunConfig
from gpo.sampler import QuestionStream

POLL_S = 0.005  # a generator waiting for weights, or a trainer for a handshake, checks this often


def sampling_version(step: int, max_staleness: int) -> int:
    """The policy version (optimizer steps taken) whose weights sample step `step`."""
    return max(0, step - max_staleness)


@dataclass
class Channel:
    """The generator's side of its link to the trainer: multiprocessing objects for a spawned process, thread-safe
    ones inside a Ray actor (gpo/async_ray.py)."""

    shared: torch.nn.Module  # the published weights (shared memory, or the actor's copy the trainer broadcasts into)
    published: Any  # .value: the version held in `shared`
    taken: Any  # .value: the version the generator last copied out of `shared`
    stop: Any  # .is_set(): the trainer is closing
    out: Any  # .put(message): messages to the trainer
    parent_pid: int  # the generator stops when its parent changes (0: not checked; a Ray actor fate-shares instead)


@dataclass
class Spec:
    """What a generator is started with (pickled into a spawned process or a Ray actor)."""

    cfg: RunConfig
    start_step: int
    state: dict[str, Any]  # the rollout state to start from (Rollout.state_dict)
    threads: int
    rank: int  # the trainer's rank; with several, the generators form a process group of their own
    world_size: int
    rendezvous: str  # "host:port" of that group's store ("" on one rank)


@dataclass
class Delivered:
    step: int
    value: Produced


class GeneratorWeights:
    """The generator's private copy of the policy and the version it holds, refreshed from the trainer's shared
    copy (whose version is `published`); `taken` tells the trainer when the shared copy may be rewritten."""

    def __init__(self, shared: torch.nn.Module, published: Any, taken: Any, model: torch.nn.Module) -> None:
        self.shared, self.published, self.taken, self.model = shared, published, taken, model
        self.version = int(published.value)
        self.taken.value = self.version
        self.inflight = 0  # versions taken inside the current step (train.weight_updates=inflight)

    def take_newer(self, backend: Any) -> bool:
        """Copy the published weights if they are newer than the ones held; `backend` follows them."""
        newest = int(self.published.value)
        if newest <= self.version:
            return False
        copy_weights(self.shared, self.model)
        self.version = newest
        self.taken.value = newest
        backend.sync_weights(self.model)  # a lower-precision copy or a vLLM engine follows
        return True

    def before_call(self, backend: Any) -> int:
        """In-flight: the newest published weights before a generation call; the version that call samples with."""
        self.inflight += self.take_newer(backend)
        return self.version


def generate_ahead(spec: Spec, channel: Channel) -> None:
    """The generator process's entry: the process-wide settings, then `run_generator`."""
    _end_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C or a pre-emption reaches the whole group: the trainer
        signal.signal(sig, signal.SIG_IGN)       # saves (which may wait for this process), then stops it
    run_generator(spec, channel)


def run_generator(spec: Spec, channel: Channel) -> None:
    """Produce steps from `spec.start_step` to train.steps - 1, each with the weights its schedule names (or newer
    ones after a restart, or in flight), and send them to the trainer; an error goes to the trainer as a message."""
    torch.set_num_threads(spec.threads)
    cfg, parts = spec.cfg, None
    try:
        registry.load_builtins()
        registry.load_plugins(cfg.plugins)
        model = copy.deepcopy(channel.shared)  # private: the trainer rewrites the shared copy while this one samples
        weights = GeneratorWeights(channel.shared, channel.published, channel.taken, model)
        if spec.world_size > 1:  # a store of its own (rank 0's trainer holds it): under torch's launcher tcp://
            host, port = spec.rendezvous.rsplit(":", 1)  # would join the trainers' store
            timeout = timedelta(seconds=cfg.engine.collective_timeout_s)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
        parts = build_parts(cfg, trainable=False, policy=model)
        # this rank's share of each generation call, over its own parts (no accelerator: nothing to gather)
        rollout = Rollout.from_parts(parts, cfg, QuestionStream(parts.task.load("train"), cfg.seed), rank=spec.rank,
                                     world_size=spec.world_size)
        rollout.load_state_dict(spec.state)
        with peer_failures_explained(lambda: "Rerun the same command with resume=auto to continue."):
            _generate_steps(spec, channel, weights, rollout, parts.backend)
    except UserError as exc:
        channel.out.put(("user_error", str(exc)))
    except BaseException:
        channel.out.put(("error", traceback.format_exc()))
    finally:
        if parts is not None:
            parts.close()


def _generate_steps(spec: Spec, channel: Channel, weights: GeneratorWeights, rollout: Rollout, backend: Any) -> None:
    """Each step from `spec.start_step` on, once the weights its schedule names have arrived, sent to the trainer."""
    cfg = spec.cfg
    refresh = partial(weights.before_call, backend) if cfg.train.weight_updates == "inflight" else None
    for step in range(spec.start_step, cfg.train.steps):
        waited = time.perf_counter()
        while weights.version < sampling_version(step, cfg.train.max_staleness):
            if weights.take_newer(backend):
                continue
            if channel.stop.is_set() or (channel.parent_pid and os.getppid() != channel.parent_pid):
                return
            time.sleep(POLL_S)
        idle = time.perf_counter() - waited
        timer, weights.inflight = PhaseTimer(), 0
        # plan, rounds, rewards, score, prune and refill, as Lockstep runs them in the trainer's process
        produced = rollout.produce(step, weights.version, timer, refresh=refresh)
        produced.state = rollout.state_dict()  # a resume from a checkpoint that queues this step continues here
        produced.metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
        produced.metrics["time/generator_idle"] = idle
        produced.metrics["async/inflight_updates"] = float(weights.inflight)
        buffer = io.BytesIO()
        torch.save(Delivered(step, produced), buffer)
        channel.out.put(("step", buffer.getvalue()))
        if channel.stop.is_set():
            return


def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    with torch.no_grad():
        for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True):
            b.copy_(a)


def _end_with_parent() -> None:
    """Linux: the kernel kills this process when its parent (the trainer) dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the generator notices a new parent at its next wait
