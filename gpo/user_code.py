"""A user's own code (reward functions, tools, environments): found by name, and run under a time bound that a busy
machine does not stretch.

Loading: `load_object("my_pkg.rewards:correct", key, ...)` imports `my_pkg.rewards` (the current directory is on
`sys.path`, so a file beside the data is found as `python -m` would find it) and returns its attribute `correct`;
`module.name` works too. Whatever goes wrong is a `UserError` naming the config key.

The time bound. A call of user code gets `timeout_s`, counted by what the call does, so that a busy machine, which
stretches computing in wall time, fails no call that would have returned on an idle one:
- computing: the call's CPU time, which load does not stretch; it overruns once it has used more than `timeout_s`
  CPU seconds;
- waiting (on a remote judge, a lock, a sleep): wall time, which waiting is made of; it overruns once `timeout_s`
  have passed and it has used no CPU for the last `IDLE_S` seconds;
- whatever it does, it overruns after `WALL_FACTOR` times `timeout_s` of wall time (a machine would have to be
  that many times oversubscribed to stretch a call within its CPU bound that far).
Where the call's CPU time cannot be read, the bound is `timeout_s` of wall time, as for a waiting call.

`Watch` applies this rule to readings of one call's CPU time. Two kinds of caller feed it:
- `call_in_thread`: the call runs in a daemon thread of this process, whose CPU time the caller reads with
  `time.pthread_getcpuclockid` (not on macOS: there the bound is wall time). Python cannot stop a thread, so a
  call that overruns is abandoned: it runs on until it returns, or the process ends. For code that must share
  this process's objects (reward functions, an environment holding an episode's state).
- a worker process (gpo/tools.py), whose CPU time `process_cpu_seconds` reads from outside: a call that overruns
  is stopped by killing its process.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpo.errors import UserError

POLL_S = 0.1  # how often a caller reads a running call's clocks (it returns at once when the call does)
IDLE_S = 1.0  # a call that used no CPU for this long is waiting, not computing
WALL_FACTOR = 10  # any call overruns after this many times its bound of wall time
CPU_CLOCKS = hasattr(time, "pthread_getcpuclockid")  # a thread's CPU time can be read from another thread


def load_object(spec: str, key: str, example: str) -> Any:
    """The attribute `spec` names (`module:name` or `module.name`); `example`: a valid spec for the message."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise UserError(f"{key}: `{spec}` is not `module:name` (e.g. {example}).")
    if os.getcwd() not in sys.path:  # a file beside the data is found, as `python -m` would find it
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UserError(f"{key}: cannot import module `{module_name}` of `{spec}`: {exc!r}.") from exc
    missing = object()
    value = getattr(module, attr, missing)
    if value is missing:
        raise UserError(f"{key}: module `{module_name}` has no attribute `{attr}` (`{spec}`).")
    return value


class Watch:
    """The time bound of one running call (the module docstring's rule), started when the call is."""

    def __init__(self, timeout_s: float, wall_factor: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.wall_factor = WALL_FACTOR if wall_factor is None else wall_factor  # read now: tests move it
        self.started = self.last_busy = time.monotonic()
        self.cpu_seen = 0.0

    def overrun(self, cpu: float | None) -> str:
        """Why the call has overrun, for a message, or "" while it has not. `cpu`: the CPU seconds it has used so
        far; None where they cannot be read."""
        now = time.monotonic()
        elapsed = now - self.started
        if cpu is None:
            return "wall time: its CPU time cannot be read here" if elapsed > self.timeout_s else ""
        if cpu > self.cpu_seen:
            self.cpu_seen, self.last_busy = cpu, now
        if cpu > self.timeout_s:
            return f"computing: {cpu:.1f} s of CPU time"
        if elapsed > self.timeout_s and now - self.last_busy >= IDLE_S:
            return f"waiting: no CPU used for {now - self.last_busy:.1f} of its {elapsed:.1f} s"
        if elapsed > self.wall_factor * self.timeout_s:
            return f"{elapsed:.1f} s of wall time, {self.wall_factor:g}x the bound, {cpu:.1f} s of it computing"
        return ""


@dataclass
class Outcome:
    """How a call in a thread ended: its value, what it raised, or why it was abandoned (then neither)."""

    value: Any = None
    error: BaseException | None = None
    overrun: str = ""  # "" when the call returned or raised within its bound


def call_in_thread(fn: Callable[[], Any], timeout_s: float, name: str) -> Outcome:
    """`fn()` in a daemon thread named `name`, abandoned when it overruns `timeout_s` (module docstring)."""
    outcome = Outcome()
    clock: list[int] = []  # the thread's CPU clock, taken by the thread itself (an ended thread's may not be asked)

    def run() -> None:
        if CPU_CLOCKS:
            clock.append(time.pthread_getcpuclockid(threading.get_ident()))
        try:
            outcome.value = fn()
        except BaseException as exc:  # handed to the caller's thread, which decides what a failure means
            outcome.error = exc

    worker = threading.Thread(target=run, name=name, daemon=True)
    watch = Watch(timeout_s)
    worker.start()
    while True:
        worker.join(POLL_S)
        if not worker.is_alive():
            return outcome
        cpu: float | None = None
        if CPU_CLOCKS:
            try:
                cpu = time.clock_gettime(clock[0]) if clock else 0.0  # no clock yet: the thread has not run
            except OSError:  # the thread ended since is_alive()
                continue
        reason = watch.overrun(cpu)
        if reason:
            return Outcome(overrun=reason)


def process_cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds process `pid` has used; None when it cannot be read (gone, or no way here).

    Linux: /proc/<pid>/stat, no dependency and cheap enough to read every `POLL_S`. Elsewhere: psutil (installed
    with Accelerate) where importable.
    """
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name (field 2) is in parentheses and may hold spaces: count the fields after it.
            fields = f.read().rpartition(b")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime and stime, fields 14 and 15
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):  # /proc exists: the process is gone
            return None
    except (OSError, ValueError, IndexError):
        return None
    try:
        import psutil
    except ImportError:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stop_worker(process: Any, conn: Any, kill: bool) -> None:
    """End a worker process and close the parent's end of its pipe: `kill` at once (it overran or is stuck), or
    ask it to finish (None on the pipe) and kill it only if it has not within a second."""
    if process.is_alive():
        if kill:
            process.kill()
        else:
            try:
                conn.send(None)
            except OSError:
                pass
        process.join(timeout=1.0)
        if process.is_alive():
            process.kill()
            process.join()
    conn.close()
