"""train.max_staleness = k >= 1: a generator process runs up to k steps ahead of the trainer (docs/async.md).

The generator process holds a private copy of the policy and its own rollout parts (task, selector, pruner,
allocator, backend) and produces whole steps, as `Lockstep` does in the engine's process: step j's rounds,
rewards, advantages and pruning, generated with the trainer's weights after max(0, j - k) steps (version
max(0, j - k)). The trainer takes step j from a queue, updates, and publishes its weights into a shared-memory
copy; the generator loads them between steps. A row is therefore trained at most k versions after the weights
that sampled it, and which weights sample which step depends on the step alone, not on timing: an async run is
reproducible, and a resumed one continues it exactly. With train.weight_updates=inflight the generator also takes
the newest published weights before each generation call inside a step (each row records the version that
sampled it): fresher rows, at the price of that reproducibility.

Checkpoints: after step s the generator's steps s .. s+k-1 were sampled by weights a checkpoint no longer holds,
so they are kept in it (`rollout_queue.pt`) with the rollout state after the last of them; on resume the
generator restarts at step s+k with the checkpoint's weights (version s), as in the uninterrupted run.
A generator process that dies is restarted from the last step it delivered (metric async/generator_restarts);
it then samples with the newest weights, which keeps the bound but not the schedule. The generator exits with
its trainer.
"""

from __future__ import annotations

import copy
import ctypes
import io
import os
import queue
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
from gpo.build import Components, build
from gpo.distributed import free_port, from_rank_zero, peer_failures_explained
from gpo.errors import UserError
from gpo.metrics import PhaseTimer
from gpo.rollout import Produced, Rollout
from gpo.run_config import RunConfig
from gpo.sampler import QuestionStream

POLL_S = 0.005  # a generator waiting for weights, or a trainer for a handshake, checks this often
MAX_RESTARTS_WITHOUT_PROGRESS = 3  # a generator dying this often before delivering a step stops the run


def sampling_version(step: int, max_staleness: int) -> int:
    """The policy version (optimizer steps taken) whose weights sample step `step`."""
    return max(0, step - max_staleness)


@dataclass
class _Spec:
    """What a generator process is started with (pickled by the spawn context; tensors travel as shared memory)."""

    cfg: RunConfig
    shared: torch.nn.Module  # the published weights, in shared memory
    published: Any  # multiprocessing Value: the version held in `shared`
    taken: Any  # multiprocessing Value: the version the generator last copied out of `shared`
    stop: Any  # multiprocessing Event
    out: Any  # multiprocessing Queue of messages to the trainer
    start_step: int
    state: dict[str, Any]  # the rollout state to start from (Rollout.state_dict)
    threads: int
    parent_pid: int
    rank: int  # the trainer's rank; with several, the generators form a process group of their own
    world_size: int
    rendezvous: str  # "host:port" of that group's store ("" on one rank)


class AsyncRollouts:
    """The engine's rollout source with a generator process (gpo.rollout.RolloutSource)."""

    def __init__(self, cfg: RunConfig, rollout: Rollout, policy: torch.nn.Module) -> None:
        self.cfg, self.rollout, self.policy = cfg, rollout, policy
        self.rank, self.world_size = rollout.rank, rollout.world_size
        self.k, self.steps = cfg.train.max_staleness, cfg.train.steps
        self.state = rollout.state_dict()  # the state after the newest step delivered (or the start)
        self.frontier = -1  # that step (-1: none yet; the generator starts at frontier + 1)
        self.ready: dict[int, Produced] = {}
        self.restarts, self.failures_in_a_row = 0, 0
        self.process: Any = None
        self.evaluation_stale = False
        self._ctx = torch.multiprocessing.get_context("spawn")

    # --- RolloutSource -----------------------------------------------------------------------------------------
    def next(self, step: int, timer: PhaseTimer) -> Produced:
        if self.process is None:
            self._start(step)
        self._receive(block=False)
        depth = len(self.ready)
        with timer("trainer_idle"):
            while step not in self.ready:
                self._receive(block=True)
        produced = self.ready.pop(step)
        produced.metrics.update({"async/queue_depth": float(depth), "async/generator_restarts": float(self.restarts)})
        return produced

    def publish(self, policy: Any, version: int, changed: bool, timer: PhaseTimer) -> None:
        """Write the weights after `version` steps into the shared copy, once the generator has copied out the
        version held there (or has delivered every step, needing no more weights)."""
        with timer("weight_sync"):
            held = int(self.published.value)
            while int(self.taken.value) < held and self.frontier < self.steps - 1:
                self._receive(block=False)
                self._alive_or_restarted()
                time.sleep(POLL_S)
            if changed:
                _copy_weights(policy, self.shared)
            self.published.value = version
        self.evaluation_stale = self.evaluation_stale or changed

    def state_dict(self) -> tuple[dict[str, Any], list[Produced]]:
        """The steps the trainer has yet to train that were sampled by older weights than its own, and the rollout
        state after the last of them. Waits for the generator to deliver them."""
        start = min(self.ready) if self.ready else self.frontier + 1
        if self.process is None:  # not started (saved before the first step): nothing generated yet
            return self.state, [self.ready[j] for j in sorted(self.ready)]
        last = min(start + self.k, self.steps) - 1
        while self.frontier < last:
            self._receive(block=True)
        queued = [self.ready[j] for j in range(start, last + 1)]
        return (queued[-1].state if queued else self.state), queued

    def load_state_dict(self, state: dict[str, Any], queued: list[Produced], step: int) -> None:
        """Continue after step `step` - 1: the queued steps are steps `step`, `step` + 1, ..."""
        self.close()
        self.state, self.ready = state, {step + i: p for i, p in enumerate(queued)}
        self.frontier = step + len(queued) - 1
        self.rollout.load_state_dict(state)

    def evaluating(self, policy: Any) -> None:
        """The trainer's own backend (used for evaluation) gets the current weights, once per change."""
        if self.evaluation_stale:
            self.rollout.backend.sync_weights(policy)
            self.evaluation_stale = False

    def close(self) -> None:
        if self.process is None:
            return
        self.stop.set()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.process = None

    # --- the generator process ---------------------------------------------------------------------------------
    def _start(self, step: int) -> None:
        """The shared weights (the trainer's, version `step`) and the generator, which starts after the newest step
        delivered; the cores are split between the two processes."""
        total = torch.get_num_threads()
        self.threads = self.cfg.engine.generator_threads or max(1, total // 2)
        torch.set_num_threads(max(1, total - self.threads))
        self.shared = copy.deepcopy(self.policy).requires_grad_(False).share_memory()
        self.published = self._ctx.Value("q", step, lock=False)
        self.taken = self._ctx.Value("q", -1, lock=False)
        self.stop = self._ctx.Event()
        self.out = self._ctx.Queue()
        self.rendezvous = ""
        if self.world_size > 1:  # each rank's generator samples its share; they gather each step's rows together
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            self.rendezvous = f"{host}:{from_rank_zero(free_port())}"
        self._spawn()

    def _spawn(self) -> None:
        self.stop.clear()
        self.taken.value = -1  # the trainer writes no weights until the new generator has copied them
        spec = _Spec(self.cfg, self.shared, self.published, self.taken, self.stop, self.out, self.frontier + 1,
                     self.state, self.threads, os.getpid(), self.rank, self.world_size, self.rendezvous)
        self.process = self._ctx.Process(target=generate_ahead, args=(spec,), daemon=True, name="gpo-generator")
        self.process.start()
        self.spawned_at = self.frontier

    def _receive(self, block: bool) -> None:
        """Take every message waiting (block: wait for one step, restarting a generator that died)."""
        while True:
            try:
                message = self.out.get(timeout=1.0) if block else self.out.get_nowait()
            except queue.Empty:
                if not block:
                    return
                self._alive_or_restarted()
                continue
            kind, payload = message
            if kind == "user_error":
                raise UserError(payload)
            if kind == "error":
                raise RuntimeError(f"the generator process failed:\n{payload}")
            delivered = torch.load(io.BytesIO(payload), weights_only=False)
            self.ready[delivered.step] = delivered.value
            self.frontier, self.state = delivered.step, delivered.value.state
            if block:
                return

    def _alive_or_restarted(self) -> None:
        if self.process is None or self.process.is_alive():
            return
        code = self.process.exitcode
        if code == 0:  # it delivered every step; they may still be in the queue
            self._receive(block=False)
            if self.frontier >= self.steps - 1:
                return
        if self.world_size > 1:
            raise UserError(f"the generator process of rank {self.rank} ended (exit code {code}) having delivered "
                            f"{self.frontier + 1} steps. With several ranks the generators gather each step's rows "
                            f"among themselves, so one cannot be restarted alone: rerun the same command with "
                            f"resume=auto to continue from the newest checkpoint.")
        if self.frontier == self.spawned_at:  # died again before delivering a step
            self.failures_in_a_row += 1
            if self.failures_in_a_row >= MAX_RESTARTS_WITHOUT_PROGRESS:
                raise RuntimeError(f"the generator process died {self.failures_in_a_row} times in a row before "
                                   f"delivering a step (last exit code {code})")
        else:
            self.failures_in_a_row = 0
        self.restarts += 1
        print(f"gpo: the generator process ended (exit code {code}); restarting it after step {self.frontier}",
              flush=True)
        self.out = self._ctx.Queue()  # a process killed while writing may leave half a message in the old one
        self._spawn()


@dataclass
class _Delivered:
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
        _copy_weights(self.shared, self.model)
        self.version = newest
        self.taken.value = newest
        backend.sync_weights(self.model)  # a lower-precision copy or a vLLM engine follows
        return True

    def before_call(self, backend: Any) -> int:
        """In-flight: the newest published weights before a generation call; the version that call samples with."""
        self.inflight += self.take_newer(backend)
        return self.version


def generate_ahead(spec: _Spec) -> None:
    """The generator process: produce steps from `spec.start_step` to train.steps - 1, each with the weights its
    schedule names (or newer ones after a restart, or in flight), and send them to the trainer."""
    _end_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C or a pre-emption reaches the whole group: the trainer
        signal.signal(sig, signal.SIG_IGN)       # saves (which may wait for this process), then stops it
    torch.set_num_threads(spec.threads)
    cfg, parts = spec.cfg, None
    try:
        registry.load_builtins()
        registry.load_plugins(cfg.plugins)
        model = copy.deepcopy(spec.shared)  # private: the trainer rewrites the shared copy while this one samples
        weights = GeneratorWeights(spec.shared, spec.published, spec.taken, model)
        if spec.world_size > 1:  # a store of its own: under torch's launcher tcp:// would join the trainers' store
            host, port = spec.rendezvous.rsplit(":", 1)
            timeout = timedelta(seconds=cfg.engine.collective_timeout_s)
            store = dist.TCPStore(host, int(port), spec.world_size, is_master=spec.rank == 0, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
        parts = build(cfg, trainable=False, policy=model)
        rollout = _rollout(cfg, parts, spec.rank, spec.world_size)
        rollout.load_state_dict(spec.state)
        with peer_failures_explained(lambda: "Rerun the same command with resume=auto to continue."):
            _generate_steps(spec, weights, rollout, parts.backend)
    except UserError as exc:
        spec.out.put(("user_error", str(exc)))
    except BaseException:
        spec.out.put(("error", traceback.format_exc()))
    finally:
        if parts is not None:
            parts.close()


def _generate_steps(spec: _Spec, weights: GeneratorWeights, rollout: Rollout, backend: Any) -> None:
    """Each step from `spec.start_step` on, once the weights its schedule names have arrived, sent to the trainer."""
    cfg = spec.cfg
    refresh = partial(weights.before_call, backend) if cfg.train.weight_updates == "inflight" else None
    for step in range(spec.start_step, cfg.train.steps):
        waited = time.perf_counter()
        while weights.version < sampling_version(step, cfg.train.max_staleness):
            if weights.take_newer(backend):
                continue
            if spec.stop.is_set() or os.getppid() != spec.parent_pid:
                return
            time.sleep(POLL_S)
        idle = time.perf_counter() - waited
        timer, weights.inflight = PhaseTimer(), 0
        produced = rollout.produce(step, weights.version, timer, refresh=refresh)
        produced.state = rollout.state_dict()  # a resume from a checkpoint that queues this step continues here
        produced.metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
        produced.metrics["time/generator_idle"] = idle
        produced.metrics["async/inflight_updates"] = float(weights.inflight)
        buffer = io.BytesIO()
        torch.save(_Delivered(step, produced), buffer)
        spec.out.put(("step", buffer.getvalue()))
        if spec.stop.is_set():
            return


def _rollout(cfg: RunConfig, parts: Components, rank: int, world_size: int) -> Rollout:
    """The generator's rollout over its own parts (gpo.build around its private model), sampling this rank's share
    of each generation call."""
    questions = QuestionStream(parts.task.load("train"), cfg.seed)
    return Rollout(cfg.train, cfg.seed, parts.task, cfg.task.name, parts.tokenizer, parts.backend, parts.objective,
                   parts.selector, parts.pruner, parts.allocator, questions, accelerator=None, policy=parts.policy,
                   rank=rank, world_size=world_size)



def _copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    with torch.no_grad():
        for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True):
            b.copy_(a)


def _end_with_parent() -> None:
    """Linux: the kernel kills this process when its parent (the trainer) dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the generator notices a new parent at its next wait
