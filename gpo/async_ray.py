"""engine.generator=ray: the generator running ahead (gpo/generator.py) as a Ray actor, on any node of a cluster.

The actor runs the same generator loop (`run_generator`) in a thread of its own. Shared memory does not reach
another node, so the weights travel over a gloo process group of two, the trainer (rank 0) and the actor (rank 1),
made beside any group the trainer already has (DDP's stays the default one): to publish a version the trainer
broadcasts every tensor of its state dict into the actor's copy, which the generator then copies out, with the
same handshake as shared memory (the trainer writes only once the generator has taken the version held). Steps
come back through the actor's queue. A non-detached actor ends with the process that created it, so a trainer
that dies takes its generator with it. With several ranks each rank has an actor of its own, all in one cluster
(rank 0 starts a local one unless engine.ray_address names one), and the actors form the generators' group as
spawned generators do. CPU tensors (gloo); an actor on a GPU (NCCL) is not built yet.
"""

from __future__ import annotations

import copy
import os
import queue
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpo.distributed import free_port
from gpo.errors import UserError
from gpo.generator import Channel, Spec, copy_weights, run_generator

AUTH_MODE = "RAY_AUTH_MODE"
RENDEZVOUS_S = 300.0  # the actor's process may have to start, import torch and load the model first


class _Value:
    """A number read and written by two threads of the actor (a multiprocessing.Value's `.value`)."""

    def __init__(self, value: int) -> None:
        self.value = value


def _pair(host: str, port: int, rank: int) -> Any:
    """A gloo group of the trainer (0) and its actor (1) on its own store, leaving the default group alone."""
    timeout = timedelta(seconds=RENDEZVOUS_S)
    store = dist.TCPStore(host, port, 2, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("gpo-weights", store), rank, 2, timeout)


def _broadcast(group: Any, module: torch.nn.Module) -> None:
    """Every tensor of `module`'s state dict from rank 0 (the trainer) into rank 1's (the actor's), in order."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    with torch.no_grad():
        for tensor in module.state_dict().values():
            group.broadcast([tensor], options).wait()


class GeneratorActor:
    """The Ray actor: holds the generator's copy of the published weights, the generator thread and its queue."""

    def start(self, spec: Spec, shared: torch.nn.Module, version: int, host: str, port: int) -> None:
        self.shared = shared.requires_grad_(False)
        self.published, self.taken = _Value(version), _Value(-1)
        self.stop = threading.Event()
        self.out: queue.Queue[Any] = queue.Queue()
        self.group = _pair(host, port, rank=1)
        channel = Channel(self.shared, self.published, self.taken, self.stop, self.out, parent_pid=0)
        self.thread = threading.Thread(target=run_generator, args=(spec, channel), name="gpo-generator", daemon=True)
        self.thread.start()

    def receive(self, version: int) -> None:
        """Join the trainer's broadcast of version `version` (it writes only once the generator took the last)."""
        _broadcast(self.group, self.shared)
        self.published.value = version

    def set_published(self, version: int) -> None:
        self.published.value = version  # an update that changed nothing: the weights held are that version's

    def taken_version(self) -> int:
        return self.taken.value

    def get(self, timeout: float | None) -> Any:
        try:
            return self.out.get(timeout=timeout) if timeout is not None else self.out.get_nowait()
        except queue.Empty:
            return None

    def running(self) -> bool:
        return self.thread.is_alive()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


class RayLink:
    """The trainer's side of a generator running as a Ray actor (the interface of gpo.async_rollout.ProcessLink)."""

    def __init__(self, policy: torch.nn.Module, version: int, address: str | None, threads: int) -> None:
        try:
            import ray
        except ImportError:
            raise UserError("engine.generator=ray needs Ray: pip install 'gpo[ray]' (or pip install ray).") from None
        if any(p.device.type != "cpu" for p in policy.parameters()):
            raise UserError("engine.generator=ray broadcasts the weights over gloo from CPU tensors; a policy on a "
                            "GPU is not supported yet. Use engine.generator=process.")
        self.ray, self.threads = ray, threads
        # the published version's weights, which a replacement actor starts from (the trainer's own may be newer)
        self.weights = copy.deepcopy(policy).requires_grad_(False)
        _init_ray(ray, address)
        self._published = version
        self.actor: Any = None
        self.group: Any = None

    def spawn(self, spec: Spec) -> None:
        """A new actor (after one died, its replacement) with the trainer's current weights."""
        if self.actor is not None:
            self.ray.kill(self.actor)
        host = self.ray.util.get_node_ip_address()
        port = free_port()
        remote = self.ray.remote(GeneratorActor).options(num_cpus=self.threads, max_concurrency=4)
        self.actor = remote.remote()
        started = self.actor.start.remote(spec, self.weights, self._published, host, port)
        self.group = _pair(host, port, rank=0)  # waits for the actor's side
        self.ray.get(started)

    def published(self) -> int:
        return self._published

    def taken(self) -> int:
        return int(self._call(self.actor.taken_version.remote(), default=-1))

    def write(self, policy: torch.nn.Module, version: int, changed: bool) -> None:
        """Broadcast version `version` into the actor's copy. An actor that died meanwhile is left to the caller's
        next liveness check, which replaces it with these weights."""
        if changed:
            copy_weights(policy, self.weights)
        self._published = version
        try:
            if changed:
                received = self.actor.receive.remote(version)
                _broadcast(self.group, self.weights)
                self.ray.get(received)
            else:
                self.ray.get(self.actor.set_published.remote(version))
        except (RuntimeError, self.ray.exceptions.RayActorError):
            if self._alive():
                raise

    def get(self, timeout: float | None) -> Any:
        return self._call(self.actor.get.remote(timeout), default=None)

    def exit_code(self) -> int | None:
        """None while the generator thread runs; 0 once it returned (its errors arrive as messages); -9 when the
        actor itself is gone (its process or node died)."""
        running = self._call(self.actor.running.remote(), default=None)
        if running is None:
            return -9
        return None if running else 0

    def close(self) -> None:
        if self.actor is None:
            return
        self._call(self.actor.close.remote(), default=None)
        self.ray.kill(self.actor)
        self.actor = None

    def _alive(self) -> bool:
        return self._call(self.actor.running.remote(), default=None) is not None

    def _call(self, ref: Any, default: Any) -> Any:
        """A call's result, or `default` when the actor died (exit_code then reports it)."""
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayActorError:
            return default


def start_local_ray() -> dict[str, str]:
    """Start this process's local Ray and say how the other ranks join it: the cluster's address, and its
    authentication mode (a new local cluster turns token authentication on for the process that starts it only;
    the token itself is saved in the user's home, where the other ranks on this machine find it)."""
    import ray

    _init_ray(ray, None)
    return {"address": str(ray.get_runtime_context().gcs_address),
            AUTH_MODE: os.environ.get(AUTH_MODE, "")}


def join_ray(how: dict[str, str]) -> str:
    """Join the cluster `start_local_ray` started on rank 0; its address, for RayLink."""
    if how[AUTH_MODE]:
        os.environ[AUTH_MODE] = how[AUTH_MODE]
    return how["address"]


def _init_ray(ray: Any, address: str | None) -> None:
    if not ray.is_initialized():  # address None: a local cluster of this process's own
        ray.init(address=address, include_dashboard=False, log_to_driver=True,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(_import_path())}})


def _import_path() -> list[str]:
    """This process's import path, so the actor finds what the trainer found (gpo itself, the user's plug-ins)."""
    import sys

    return [p for p in sys.path if p and os.path.isdir(p)]
