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

Each call runs in a daemon thread bounded by `task.reward_timeout_s` (gpo/user_code.py's `call_in_thread`): Python
cannot stop a thread, so a call that overruns is abandoned (it runs on until it returns, or the process ends) and
reported as a failure. What is counted depends on what the call does, so that a busy machine fails no call that
would have returned on an idle one: the thread's CPU time while it computes (more than `reward_timeout_s` CPU
seconds fails it), wall time while it waits (`reward_timeout_s`, once its thread has used no CPU for
`gpo.user_code.IDLE_S` seconds), and `gpo.user_code.WALL_FACTOR` times `reward_timeout_s` of wall time whatever it
does. Where a thread's CPU clock cannot be read (e.g. macOS), the bound is `reward_timeout_s` of wall time.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpo.errors import UserError
from gpo.user_code import call_in_thread, load_object

# what every call offers besides the row's columns (`environments`: a multi-turn run's instances, else None)
PASSED = ("prompts", "completions", "completion_ids", "environments")


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
    fn = load_object(spec, "task.rewards", "my_pkg.rewards:correct")
    attr = spec.partition(":")[2] or spec.rpartition(".")[2]
    if not callable(fn):
        raise UserError(f"task.rewards: `{spec}` is not a function (its type is {type(fn).__name__}).")
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
         completion_ids: Sequence[Any] | None, columns: dict[str, list[Any]],
         environments: Sequence[Any] | None = None) -> list[float | None]:
    """One call on a batch: a float (NaN passes through, for the caller's check) or None per completion."""
    offered = {"prompts": list(prompts), "completions": list(completions), "completion_ids": completion_ids,
               "environments": None if environments is None else list(environments),
               **{k: v for k, v in columns.items() if k not in PASSED}}
    kwargs = offered if reward.accepts is None else {k: v for k, v in offered.items() if k in reward.accepts}
    outcome = call_in_thread(lambda: reward.fn(**kwargs), timeout_s, f"gpo-reward-{reward.name}")
    if outcome.overrun:
        raise RewardFunctionError(f"reward function `{reward.name}` ({reward.spec}) did not return within "
                                  f"task.reward_timeout_s={timeout_s:g} s on {len(completions)} completions "
                                  f"({outcome.overrun})")
    if outcome.error is not None:
        exc = outcome.error
        raise RewardFunctionError(f"reward function `{reward.name}` ({reward.spec}) raised "
                                  f"{type(exc).__name__}: {exc}").with_traceback(exc.__traceback__)
    return _values(reward, outcome.value, len(completions))


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
