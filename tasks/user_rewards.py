"""A user's own reward functions (`task.rewards=[my_pkg.rewards:correct]`), called as TRL calls them.

TRL's convention (GRPOTrainer's `reward_funcs`): `fn(prompts=..., completions=..., completion_ids=..., **columns)`
with one list entry per completion and every other column of the row as a list too, returning one float per
completion (NaN and infinities are failures), or None where the function does not apply (scored 0 here and
counted). A function whose signature has no `**kwargs` is given only the arguments it names, so
`def f(prompts, completions, answer)` works unchanged. `completion_ids` is None where the caller does not pass the
token ids to gpo/rewards.py's `score` (evaluation grades text only).

Completions are plain strings and prompts the user message's text (TRL's "standard" format) unless the task says
`reward_format: conversational`: then, as TRL passes a conversational dataset, each prompt is the chat turns and
each completion `[{"role": "assistant", "content": text}]`. Plain strings are the default because gpo always
prompts through the chat template, and most reward functions (TRL's own examples included) read text.

Each call runs in a daemon thread bounded by `task.reward_timeout_s`: Python cannot stop a thread, so a call that
overruns is abandoned (it runs on until it returns, or the process ends) and reported as a failure. What is counted
depends on what the call does, so that a busy machine, which stretches computing in wall time, fails no call that
would have returned on an idle one:
- computing: the thread's CPU time (read from the caller with `time.pthread_getcpuclockid`), which load does not
  stretch; a call fails once it has used more than `reward_timeout_s` CPU seconds;
- waiting (on a remote judge, a lock, a sleep): wall time, which waiting is made of; a call fails once
  `reward_timeout_s` have passed and its thread has used no CPU for the last `IDLE_S` seconds;
- whatever it does, a call fails after `WALL_FACTOR` times `reward_timeout_s` of wall time (a machine would have to
  be that many times oversubscribed to stretch a call within its CPU bound that far).
Where a thread's CPU clock cannot be read (no `pthread_getcpuclockid`, e.g. macOS), the bound is
`reward_timeout_s` of wall time, as for a waiting call.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpo.errors import UserError

PASSED = ("prompts", "completions", "completion_ids")  # what every call offers besides the row's columns
POLL_S = 0.1  # how often the caller reads a running call's clocks (it returns at once when the call does)
IDLE_S = 1.0  # a call whose thread used no CPU for this long is waiting, not computing
WALL_FACTOR = 10  # any call is abandoned after this many times task.reward_timeout_s of wall time
CPU_CLOCKS = hasattr(time, "pthread_getcpuclockid")  # a thread's CPU time can be read from another thread


class RewardFunctionError(Exception):
    """A user reward function raised, overran its time or returned a non-number: a failure under the task's
    `reward_errors` policy (gpo/rewards.py), like a built-in reward raising."""


@dataclass(frozen=True)
class RewardFunction:
    spec: str  # as given: "my_pkg.rewards:correct"
    name: str  # the reward component's name: the function's own
    fn: Callable[..., Any]
    accepts: frozenset[str] | None  # the keyword arguments it takes; None when it takes **kwargs
    needs: frozenset[str]  # its parameters without a default

    def columns_needed(self) -> set[str]:
        """The row columns it cannot run without (every required parameter not offered by every call)."""
        return set(self.needs) - set(PASSED)


def load(spec: str) -> RewardFunction:
    """The function `module:name` (or `module.name`), checked to take `completions` + keyword arguments."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise UserError(f"task.rewards: `{spec}` is not `module:function` (e.g. my_pkg.rewards:correct).")
    if os.getcwd() not in sys.path:  # a rewards.py beside the data is found, as `python -m` would find it
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UserError(f"task.rewards: cannot import module `{module_name}` of `{spec}`: {exc!r}.") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"task.rewards: module `{module_name}` has no function `{attr}` (`{spec}`).")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        raise UserError(f"task.rewards: cannot read the signature of `{spec}`: {exc}.") from exc
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    names = {p.name for p in params if p.kind in keyword}
    positional_only = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY
                       and p.default is inspect.Parameter.empty]
    if positional_only or not (takes_all or "completions" in names):
        raise UserError(f"task.rewards: `{spec}` cannot be called as fn(completions=..., **kwargs) (TRL's "
                        f"convention): its signature is {attr}{inspect.signature(fn)}. Give it a `completions` "
                        "parameter and `**kwargs`.")
    needs = frozenset(p.name for p in params if p.kind in keyword and p.default is inspect.Parameter.empty)
    return RewardFunction(spec, attr, fn, None if takes_all else frozenset(names), needs)


def call(reward: RewardFunction, timeout_s: float, prompts: Sequence[Any], completions: Sequence[Any],
         completion_ids: Sequence[Any] | None, columns: dict[str, list[Any]]) -> list[float | None]:
    """One call on a batch: a float (NaN passes through, for the caller's check) or None per completion."""
    offered = {"prompts": list(prompts), "completions": list(completions), "completion_ids": completion_ids,
               **{k: v for k, v in columns.items() if k not in PASSED}}
    kwargs = offered if reward.accepts is None else {k: v for k, v in offered.items() if k in reward.accepts}
    outcome: dict[str, Any] = {}

    def run() -> None:
        if CPU_CLOCKS:  # taken by the thread itself: the id of a thread that has ended may not be asked about
            outcome["clock"] = time.pthread_getcpuclockid(threading.get_ident())
        try:
            outcome["value"] = reward.fn(**kwargs)
        except BaseException as exc:  # handed to the caller's thread, which applies the failure policy
            outcome["error"] = exc

    worker = threading.Thread(target=run, name=f"gpo-reward-{reward.name}", daemon=True)
    worker.start()
    overrun = _watch(worker, outcome, timeout_s)
    if overrun:
        raise RewardFunctionError(f"reward function `{reward.name}` ({reward.spec}) did not return within "
                                  f"task.reward_timeout_s={timeout_s:g} s on {len(completions)} completions "
                                  f"({overrun})")
    if "error" in outcome:
        exc = outcome["error"]
        raise RewardFunctionError(f"reward function `{reward.name}` ({reward.spec}) raised "
                                  f"{type(exc).__name__}: {exc}").with_traceback(exc.__traceback__)
    return _values(reward, outcome.get("value"), len(completions))


def _watch(worker: threading.Thread, outcome: dict[str, Any], timeout_s: float) -> str:
    """Wait for `worker` to end; if it overruns first (module docstring), why, for the message; else ""."""
    started = last_busy = time.monotonic()
    cpu_seen = 0.0
    while True:
        worker.join(POLL_S)
        if not worker.is_alive():
            return ""
        now = time.monotonic()
        elapsed = now - started
        if not CPU_CLOCKS:
            if elapsed > timeout_s:
                return "wall time: a thread's CPU time cannot be read here"
            continue
        clock = outcome.get("clock")
        try:
            cpu = time.clock_gettime(clock) if clock is not None else 0.0  # None: the thread has not run yet
        except OSError:  # the thread ended since is_alive()
            continue
        if cpu > cpu_seen:
            cpu_seen, last_busy = cpu, now
        if cpu > timeout_s:
            return f"computing: {cpu:.1f} s of CPU time"
        if elapsed > timeout_s and now - last_busy >= IDLE_S:
            return f"waiting: no CPU used for {now - last_busy:.1f} of its {elapsed:.1f} s"
        if elapsed > WALL_FACTOR * timeout_s:
            return f"{elapsed:.1f} s of wall time, {WALL_FACTOR}x the bound, {cpu:.1f} s of it computing"


def _values(reward: RewardFunction, value: Any, n: int) -> list[float | None]:
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = f"{len(value)} values" if isinstance(value, (list, tuple)) else type(value).__name__
        raise UserError(f"reward function `{reward.name}` ({reward.spec}) must return a list of one float (or None) "
                        f"per completion: got {got} for {n} completions.")
    out: list[float | None] = []
    for i, v in enumerate(value):
        if v is None:
            out.append(None)
            continue
        try:
            number = float(v)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):  # a NaN would spread through its group's mean into every advantage
            raise RewardFunctionError(f"reward function `{reward.name}` ({reward.spec}) returned {v!r} for "
                                      f"completion {i}, not a finite number or None")
        out.append(number)
    return out
