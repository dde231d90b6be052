"""train.max_staleness = k >= 1, the trainer's side: a generator (gpo/generator.py) runs up to k steps ahead
(docs/async.md).

The trainer takes step j from the generator's queue, updates, and publishes its weights; step j was sampled by the
weights after max(0, j - k) steps, so a row is trained at most k versions after the weights that sampled it, and
which weights sample which step depends on the step alone, not on timing: an async run is reproducible, and a
resumed one continues it exactly (train.weight_updates=inflight trades that for fresher rows). The generator runs
in a process spawned here, the weights through shared memory (`ProcessLink`), or as a Ray actor
(engine.generator=ray, gpo/async_ray.py); either link offers the same calls.

Checkpoints: after step s the generator's steps s .. s+k-1 were sampled by weights a checkpoint no longer holds,
so they are kept in it (`rollout_queue.pt`) with the rollout state after the last of them; on resume the
generator restarts at step s+k with the checkpoint's weights (version s), as in the uninterrupted run.
A generator that dies is restarted from the last step it delivered (metric async/generator_restarts); it then
samples with the newest weights, which keeps the bound but not the schedule. With several ranks it is not (its
peers wait in the same gather): the run stops and resume=auto continues it. The generator exits with its trainer.
"""

from __future__ import annotations

import copy
import io
import os
import queue
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpo.distributed import free_port, from_rank_zero
from gpo.errors import UserError
from gpo.generator import POLL_S, Channel, Spec, copy_weights, generate_ahead
from gpo.metrics import PhaseTimer
from gpo.rollout import Produced, Rollout
from gpo.run_config import RunConfig

MAX_RESTARTS_WITHOUT_PROGRESS = 3  # a generator dying this often before delivering a step stops the run


class AsyncRollouts:
    """The engine's rollout source with a generator running ahead (gpo.rollout.RolloutSource)."""

    def __init__(self, cfg: RunConfig, rollout: Rollout, policy: torch.nn.Module) -> None:
        self.cfg, self.rollout, self.policy = cfg, rollout, policy
        self.rank, self.world_size = rollout.rank, rollout.world_size
        self.k, self.steps = cfg.train.max_staleness, cfg.train.steps
        self.state = rollout.state_dict()  # the state after the newest step delivered (or the start)
        self.frontier = -1  # that step (-1: none yet; the generator starts at frontier + 1)
        self.ready: dict[int, Produced] = {}
        self.restarts, self.failures_in_a_row = 0, 0
        self.link: Any = None  # ProcessLink or gpo.async_ray.RayLink, once started
        self.store: Any = None  # with several ranks, on rank 0: where the generators meet
        self.evaluation_stale = False

    # --- RolloutSource -----------------------------------------------------------------------------------------
    def next(self, step: int, timer: PhaseTimer) -> Produced:
        if self.link is None:
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
        """Write the weights after `version` steps into the generator's shared copy, once the generator has copied
        out the version held there (or has delivered every step, needing no more weights)."""
        with timer("weight_sync"):
            held = self.link.published()
            while self.link.taken() < held and self.frontier < self.steps - 1:
                self._receive(block=False)
                self._alive_or_restarted()
                time.sleep(POLL_S)
            self.link.write(policy, version, changed)
        self.evaluation_stale = self.evaluation_stale or changed

    def state_dict(self) -> tuple[dict[str, Any], list[Produced]]:
        """The steps the trainer has yet to train that were sampled by older weights than its own, and the rollout
        state after the last of them. Waits for the generator to deliver them."""
        start = min(self.ready) if self.ready else self.frontier + 1
        if self.link is None:  # not started (saved before the first step): nothing generated yet
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
        if self.link is not None:
            self.link.close()
            self.link = None

    # --- the generator -----------------------------------------------------------------------------------------
    def _start(self, step: int) -> None:
        """The generator's copy of the weights (the trainer's, version `step`) and the generator, which starts after
        the newest step delivered; the cores are split between the two processes."""
        total = torch.get_num_threads()
        self.threads = self.cfg.engine.generator_threads or max(1, total // 2)
        torch.set_num_threads(max(1, total - self.threads))
        self.rendezvous = self._generators_store() if self.world_size > 1 else ""
        if self.cfg.engine.generator == "ray":
            from gpo.async_ray import RayLink, join_ray, start_local_ray

            address = self.cfg.engine.ray_address
            if self.world_size > 1 and not address:  # one local cluster for every rank's actor, started by rank 0
                address = join_ray(from_rank_zero(start_local_ray() if self.rank == 0 else None))
            self.link = RayLink(self.policy, step, address, self.threads)
        else:
            self.link = ProcessLink(self.policy, step)
        self._spawn()

    def _generators_store(self) -> str:
        """Where the ranks' generators meet to form their group: a store that rank 0's trainer holds, so that a
        generator anywhere (a process here, a Ray actor on any node) only connects to it. "host:port"."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = from_rank_zero(free_port())
        if self.rank == 0:
            self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=self.cfg.engine.collective_timeout_s))
        return f"{host}:{port}"

    def _spawn(self) -> None:
        self.link.spawn(Spec(self.cfg, self.frontier + 1, self.state, self.threads, self.rank, self.world_size,
                             self.rendezvous))
        self.spawned_at = self.frontier

    def _receive(self, block: bool) -> None:
        """Take every message waiting (block: wait for one step, restarting a generator that died)."""
        while True:
            message = self.link.get(timeout=1.0 if block else None)
            if message is None:
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
        code = None if self.link is None else self.link.exit_code()
        if code is None:
            return
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
        self._spawn()


class ProcessLink:
    """A generator in a process spawned on this machine; the weights travel through shared memory."""

    def __init__(self, policy: torch.nn.Module, version: int) -> None:
        self._ctx = torch.multiprocessing.get_context("spawn")
        self.shared = copy.deepcopy(policy).requires_grad_(False).share_memory()
        self._published = self._ctx.Value("q", version, lock=False)
        self._taken = self._ctx.Value("q", -1, lock=False)
        self.stop = self._ctx.Event()
        self.out = self._ctx.Queue()
        self.process: Any = None

    def spawn(self, spec: Spec) -> None:
        """Start a generator (again, after one died: with a fresh queue, as one killed while writing may have left
        half a message in the old one)."""
        if self.process is not None:
            self.out = self._ctx.Queue()
        self.stop.clear()
        self._taken.value = -1  # the trainer writes no weights until the new generator has copied them
        channel = Channel(self.shared, self._published, self._taken, self.stop, self.out, os.getpid())
        self.process = self._ctx.Process(target=generate_ahead, args=(spec, channel), daemon=True,
                                         name="gpo-generator")
        self.process.start()

    def published(self) -> int:
        return int(self._published.value)

    def taken(self) -> int:
        return int(self._taken.value)

    def write(self, policy: torch.nn.Module, version: int, changed: bool) -> None:
        if changed:
            copy_weights(policy, self.shared)
        self._published.value = version

    def get(self, timeout: float | None) -> Any:
        """The next message, or None when none came within `timeout` seconds (None: none waiting now)."""
        try:
            return self.out.get(timeout=timeout) if timeout is not None else self.out.get_nowait()
        except queue.Empty:
            return None

    def exit_code(self) -> int | None:
        """None while the generator runs."""
        return None if self.process.is_alive() else self.process.exitcode

    def close(self) -> None:
        self.stop.set()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
