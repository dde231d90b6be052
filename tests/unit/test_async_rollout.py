"""The trainer's side of a generator process (gpo/async_rollout.py) where no process needs to run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpo.async_rollout import AsyncRollouts
from gpo.config import compose
from gpo.errors import UserError


class Ended:
    """A generator process that has exited."""

    exitcode = -9

    def is_alive(self) -> bool:
        return False


def test_with_several_ranks_a_dead_generator_stops_the_run_saying_how_to_resume(monkeypatch):
    """The generators of several ranks gather each step's rows among themselves: one restarted alone would wait for
    peers that have moved on, so the rank says what happened and how to continue instead."""
    cfg = compose(["train.max_staleness=1", "task=arith"])
    rollout = SimpleNamespace(rank=1, world_size=2, state_dict=dict)
    rollouts = AsyncRollouts(cfg, rollout, policy=None)
    rollouts.process, rollouts.frontier = Ended(), 2
    spawned = []
    monkeypatch.setattr(rollouts, "_spawn", lambda: spawned.append(1))
    with pytest.raises(UserError, match="generator process of rank 1 ended .exit code -9. having delivered 3 steps"
                                        ".*resume=auto"):
        rollouts._alive_or_restarted()
    assert not spawned

    alone = AsyncRollouts(cfg, SimpleNamespace(rank=0, world_size=1, state_dict=dict), policy=None)
    alone.process, alone.frontier, alone.spawned_at = Ended(), 2, 0
    alone.out = None
    monkeypatch.setattr(alone, "_spawn", lambda: spawned.append(1))
    monkeypatch.setattr(alone, "_ctx", SimpleNamespace(Queue=lambda: None))
    alone._alive_or_restarted()  # one rank: restarted (async/generator_restarts)
    assert spawned == [1] and alone.restarts == 1
