"""Environments (`task.environment=my_pkg.games:GuessNumber`), in TRL's convention, and one step beyond it.

An environment is a class the run makes one instance of per trajectory, with no arguments:
- `reset(self, **row)` (required) starts the episode from the dataset row: it is given the row's columns it names
  (all of them when it takes `**kwargs`) and returns None or text, which is appended to the user turn;
- its other public methods are the trajectory's tools, each with type hints and a Google-style docstring like a
  `task.tools` function (gpo/tools.py), shown to the model without `self`;
- `get_reward(self) -> float` (optional) is one more reward component, named after the class;
- `respond(self, message: str) -> str | None` (optional, beyond TRL) answers a model turn that calls no tool:
  its text becomes the next user turn, and None ends the episode. A game or a simulated user is written this way;
- `close(self)` (optional) is never a tool, so an environment may free what it holds there.

Environments run in this process, not in worker processes like `task.tools` functions: an instance holds the
episode's state (the hidden number, the board), which its methods change and `get_reward` and the reward functions
(`environments=`) read afterwards, so it must live where the rewards are computed. Each call is bounded as
user reward functions are (gpo/user_code.py's `call_in_thread`: CPU time while it computes, wall time while it
waits, a wall backstop whatever it does). Python cannot stop a thread, so a call that overruns is abandoned, not
killed: it runs on in the background and may still change the instance, which the trajectory should then not
trust further.

A tool method behaves like a tool: raising, overrunning, returning something that is not text, a malformed call or
wrong arguments give the model an error result (`call_method`). `reset`, `respond` and `get_reward` are the
environment's own workings, so their failure (raising, overrunning, returning the wrong type) means the
environment is broken: `EnvironmentFailure`, reported as the run's error.
"""

from __future__ import annotations

import inspect
import math
import numbers
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpo.errors import UserError
from gpo.tools import ToolCall, ToolResult, check_call, describe, invoke, overran, raised, result_text
from gpo.user_code import call_in_thread, load_object

RESERVED = ("reset", "respond", "get_reward", "close")  # methods with a meaning of their own, never tools


class EnvironmentFailure(RuntimeError):
    """An environment's `reset`, `respond` or `get_reward` raised, overran its time or returned the wrong type."""


@dataclass(frozen=True)
class Environment:
    """A user's environment class, checked."""

    spec: str  # as given: "my_pkg.games:GuessNumber"
    cls: type
    name: str  # the class's name: the reward component of get_reward
    tools: tuple[str, ...]  # public methods other than RESERVED
    schemas: tuple[dict, ...]  # of those methods (bound: no `self`), as for task.tools
    responds: bool  # defines respond(message: str) -> str | None
    rewards: bool  # defines get_reward() -> float


def load_environment(spec: str, key: str = "task.environment") -> Environment:
    """The class `spec` names, checked (module docstring); what is wrong is a UserError naming `key`."""
    cls = load_object(spec, key, "my_pkg.games:GuessNumber")
    if not inspect.isclass(cls):
        raise UserError(f"{key}: `{spec}` is not a class (its type is {type(cls).__name__}).")
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise UserError(f"{key}: `{spec}` cannot be made without arguments (it takes "
                        f"{_parameters(cls)}): one instance is made per trajectory as {cls.__name__}().") from None
    except ValueError:  # no signature to read (a class implemented in C): making it will tell
        pass
    if _method(cls, "reset") is None:
        raise UserError(f"{key}: `{spec}` has no method `reset`; define `def reset(self, **row) -> str | None`, "
                        "which starts an episode from a dataset row.")
    for name, args in (("respond", ("message",)), ("get_reward", ())):
        method = _method(cls, name)
        if method is not None:
            try:
                inspect.signature(method).bind(*args)
            except TypeError:
                wanted = "respond(self, message: str) -> str | None" if name == "respond" else \
                    "get_reward(self) -> float"
                raise UserError(f"{key}: `{spec}`'s `{name}` takes {_parameters(method)}; it must be "
                                f"`{wanted}`.") from None
            except ValueError:
                pass
    methods = {n: m for n in sorted(dir(cls)) if not n.startswith("_") and n not in RESERVED
               and (m := _method(cls, n)) is not None}
    schemas = tuple(describe(m, f"{spec}.{n}", key) for n, m in methods.items())
    return Environment(spec, cls, cls.__name__, tuple(methods), schemas, _method(cls, "respond") is not None,
                       _method(cls, "get_reward") is not None)


def _parameters(fn: Callable[..., Any]) -> str:
    """"(a, b=..., *rest)": a callable's parameters by name (annotations left out: they may be unevaluated text)."""
    shown = [("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
             + ("=..." if p.default is not p.empty else "") for p in inspect.signature(fn).parameters.values()]
    return f"({', '.join(shown)})"


def _method(cls: type, name: str) -> Callable[..., Any] | None:
    """`cls.name` as an instance would call it (bound, so without `self`) when it is a method; else None."""
    attr = inspect.getattr_static(cls, name, None)
    if isinstance(attr, staticmethod):
        return attr.__func__
    if isinstance(attr, classmethod):
        return types.MethodType(attr.__func__, cls)
    if inspect.isfunction(attr):
        return types.MethodType(attr, object())  # bound to a stand-in: only its signature and docstring are read
    return None


def call_method(instance: object, call: ToolCall, env: Environment, timeout_s: float) -> ToolResult:
    """One of the environment's tools on this trajectory's instance, bounded; same results as a ToolRunner's."""
    refused = check_call(call, dict(zip(env.tools, env.schemas, strict=True)))
    if refused is not None:
        return refused
    name, arguments = call.name or "", call.arguments or {}
    started = time.monotonic()
    outcome = call_in_thread(lambda: invoke(getattr(instance, name), **arguments), timeout_s,
                             f"gpo-env-{env.name}.{name}")
    seconds = time.monotonic() - started
    if outcome.overrun:
        return ToolResult(name, overran(name, timeout_s, outcome.overrun, "abandoned"), True, seconds)
    if outcome.error is not None:
        return ToolResult(name, raised(name, outcome.error), True, seconds)
    content, failure = result_text(name, outcome.value)
    return ToolResult(name, content, failure, seconds)


def reset(instance: Any, row: dict, timeout_s: float) -> str | None:
    """`instance.reset(**row)`, given the columns it names (all when it takes **kwargs): None or text."""
    fn = instance.reset
    what = f"{type(instance).__name__}.reset"
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        kwargs = dict(row)
    else:
        if any(p.kind is p.VAR_KEYWORD for p in params):
            kwargs = dict(row)
        else:
            named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            kwargs = {k: v for k, v in row.items() if k in named}
            needed = [p.name for p in params if p.name not in row and p.default is p.empty
                      and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            if needed:
                raise EnvironmentFailure(f"{what} needs {', '.join(f'`{n}`' for n in needed)}, which the row does "
                                         f"not have (its columns: {', '.join(sorted(row)) or 'none'})")
    return _text_or_none(what, _bounded(what, lambda: invoke(fn, **kwargs), timeout_s))


def respond(instance: object, message: str, timeout_s: float) -> str | None:
    """The environment's answer to a model turn without a tool call: the next user turn, or None (the episode
    ends, as it does for an environment without `respond`)."""
    fn = getattr(instance, "respond", None)
    if fn is None:
        return None
    what = f"{type(instance).__name__}.respond"
    return _text_or_none(what, _bounded(what, lambda: invoke(fn, message), timeout_s))


def reward(instance: object, timeout_s: float) -> float:
    """`instance.get_reward()`, checked to be a finite number."""
    what = f"{type(instance).__name__}.get_reward"
    fn = getattr(instance, "get_reward", None)
    if fn is None:
        raise EnvironmentFailure(f"{what} is not defined")
    value = _bounded(what, lambda: invoke(fn), timeout_s)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise EnvironmentFailure(f"{what} returned {_shown(value)}, not a finite number")
    return float(value)


def _bounded(what: str, fn: Callable[[], Any], timeout_s: float) -> Any:
    outcome = call_in_thread(fn, timeout_s, f"gpo-env-{what}")
    if outcome.overrun:
        raise EnvironmentFailure(f"{what} did not return within {timeout_s:g} s ({outcome.overrun})")
    if outcome.error is not None:
        exc = outcome.error
        raise EnvironmentFailure(f"{what} raised {type(exc).__name__}: {exc}").with_traceback(exc.__traceback__)
    return outcome.value


def _text_or_none(what: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise EnvironmentFailure(f"{what} returned {_shown(value)}, not text or None")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."
