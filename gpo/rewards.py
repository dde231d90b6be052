"""Guarded scoring: a task's reward function on one batch of completions, so a failure is never a silent wrong reward.

A task's `reward` should not raise on model output (docs/architecture.md), but a plug-in task may, on one odd
completion, and a user's own reward function (`task=dataset`'s `task.rewards`) may raise, overrun its time bound or
return NaN.
What happens then is the task's choice, through its attribute `reward_errors`:

- "raise" (the default): the run stops with a `UserError` that names the task, the exception and where it was
  raised, and which completion of the batch it failed on.
- "zero": a task declares that its reward function may fail on a completion and that scoring such a completion 0 is
  right (e.g. a parser that gives up on garbage). The batch is then scored one completion at a time; each that
  raises scores 0 on every component and counts in the metric `reward/errors` (always logged for such a task).
  A batch on which every completion raises still stops the run: that is a broken reward function, not odd output.
  A reward that depends on the batch as a whole (e.g. normalised over it) should not opt in: the re-scored
  completions would each be scored alone.

Either way what comes back is checked: one value per completion in `total` and in every component (else the task
is broken: a `UserError`), and finite numbers. A NaN or infinite score is treated as that completion raising: it
would otherwise spread through the group's mean and standard deviation into every advantage of the group.

`completion_ids` (each completion's generated token ids), when the caller has them, reach a task whose `reward`
takes a `completion_ids` keyword (`task=dataset` hands them to TRL-style functions); other tasks never see them.
Multi-turn rollouts (gpo/agent.py) also offer `trajectories` (each completion's chat turns) and `environments`
(each trajectory's environment instance) the same way.
"""

from __future__ import annotations

import inspect
import math
import traceback
from typing import Any

from gpo.errors import UserError
from gpo.types import Example, Rewards

RAISE, ZERO = "raise", "zero"
ERRORS_METRIC = "errors"  # the engine logs task metrics as reward/<name>


def reward_errors_policy(task: Any, name: str) -> str:
    policy = getattr(task, "reward_errors", RAISE)
    if policy not in (RAISE, ZERO):
        raise UserError(f"task `{name}`: reward_errors must be `{RAISE}` or `{ZERO}`, got `{policy}`.")
    return policy


def score(task: Any, name: str, completions: list[str], examples: list[Example],
          completion_ids: list[list[int]] | None = None, trajectories: list[list[dict]] | None = None,
          environments: list[Any] | None = None) -> Rewards:
    """`task.reward(completions, examples)`, checked, with the task's `reward_errors` policy applied. Each of
    `completion_ids`, `trajectories` and `environments` given (one entry per completion) reaches a task whose
    `reward` takes a keyword of that name."""
    policy = reward_errors_policy(task, name)
    extras = {"completion_ids": completion_ids, "trajectories": trajectories, "environments": environments}
    reward = _reward_fn(task, {k: v for k, v in extras.items() if v is not None})
    try:
        rewards = _checked(reward(completions, examples, None), len(completions), name)
    except _BadScore as exc:
        if policy == RAISE:
            raise _stop(name, exc.cause, _first_failure(reward, completions, examples, name)) from exc.cause
        return _one_by_one(reward, name, completions, examples)
    except UserError:
        raise
    except Exception as exc:
        if policy == RAISE:
            raise _stop(name, exc, _first_failure(reward, completions, examples, name)) from exc
        return _one_by_one(reward, name, completions, examples)
    if policy == ZERO:
        rewards.metrics = {**rewards.metrics, ERRORS_METRIC: 0.0}
    return rewards


def _reward_fn(task: Any, extras: dict[str, list[Any]]) -> Any:
    """`task.reward` as fn(completions, examples, rows): `rows` picks the completions' extras (None: all of them);
    only the extras `task.reward` names are passed."""
    taken = inspect.signature(task.reward).parameters
    extras = {k: v for k, v in extras.items() if k in taken}

    def reward(completions: list[str], examples: list[Example], rows: list[int] | None) -> Rewards:
        return task.reward(completions, examples,
                           **{k: v if rows is None else [v[i] for i in rows] for k, v in extras.items()})

    return reward


class _BadScore(Exception):
    """A non-finite score, carried out of `_checked` like an exception the reward function raised."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _checked(rewards: Rewards, n: int, name: str) -> Rewards:
    sizes = {"total": len(rewards.total), **{k: len(v) for k, v in rewards.components.items()}}
    wrong = {k: size for k, size in sizes.items() if size != n}
    if wrong:
        raise UserError(f"task `{name}`: reward returned the wrong number of scores for {n} completions: "
                        + ", ".join(f"{k} has {size}" for k, size in wrong.items()) + ".")
    for key, values in [("total", rewards.total), *rewards.components.items()]:
        for i, v in enumerate(values):
            if not _finite(v):
                raise _BadScore(ValueError(f"`{key}` of completion {i} is {v!r}, not a finite number"))
    return rewards


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _one_by_one(reward: Any, name: str, completions: list[str], examples: list[Example]) -> Rewards:
    """Score each completion alone; those that fail get 0 everywhere and are counted."""
    scored: list[Rewards | None] = []
    last_error: Exception | None = None
    for i, (completion, example) in enumerate(zip(completions, examples, strict=True)):
        try:
            scored.append(_checked(reward([completion], [example], [i]), 1, name))
        except UserError:
            raise
        except _BadScore as exc:
            scored.append(None)
            last_error = exc.cause
        except Exception as exc:
            scored.append(None)
            last_error = exc
    good = [r for r in scored if r is not None]
    if not good:
        raise UserError(f"task `{name}`: reward raised on every one of {len(completions)} completions, so this is "
                        f"not one odd completion (reward_errors = \"zero\" does not cover it): "
                        f"{_describe(last_error)}.") from last_error
    components = sorted({k for r in good for k in r.components})
    metrics: dict[str, float] = {}
    for r in good:
        for k, v in r.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + float(v)
    metrics[ERRORS_METRIC] = float(len(scored) - len(good))
    return Rewards(
        total=[r.total[0] if r is not None else 0.0 for r in scored],
        components={k: [r.components[k][0] if r is not None and k in r.components else 0.0 for r in scored]
                    for k in components},
        metrics=metrics,
    )


def _first_failure(reward: Any, completions: list[str], examples: list[Example], name: str) -> str:
    """Which completion the reward function fails on alone, for the error message ('' if none does)."""
    for i, (completion, example) in enumerate(zip(completions, examples, strict=True)):
        try:
            _checked(reward([completion], [example], [i]), 1, name)
        except Exception:
            shown = completion if len(completion) <= 200 else completion[:200] + "..."
            return f" It fails on completion {i} of the batch alone: {shown!r}."
    return ""


def _stop(name: str, exc: Exception, where: str) -> UserError:
    return UserError(
        f"task `{name}`: reward raised {_describe(exc)}.{where} Fix the reward function, or, if scoring such a "
        f"completion 0 is right, set `reward_errors = \"zero\"` on the task class, or `task.reward_errors=zero` for "
        f"task=dataset (counted in reward/errors)."
    )


def _describe(exc: Exception | None) -> str:
    if exc is None:
        return "nothing"
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return f"{type(exc).__name__}: {exc}{at}"
