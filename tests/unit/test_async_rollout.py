"""The trainer's side of a generator running ahead (gpo/async_rollout.py) where no generator needs to run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpo.async_rollout import AsyncRollouts
from gpo.config import compose
from gpo.errors import UserError


class EndedLink:
    """A link whose generator has exited with -9; counts the restarts asked of it."""

    def __init__(self) -> None:
        self.spawned = 0

    def exit_code(self) -> int:
        return -9

    def spawn(self, spec) -> None:
        self.spawned += 1


def rollouts(rank: int, world_size: int) -> AsyncRollouts:
    cfg = compose(["train.max_staleness=1", "task=arith"])
    source = AsyncRollouts(cfg, SimpleNamespace(rank=rank, world_size=world_size, state_dict=dict), policy=None)
    source.link, source.frontier, source.spawned_at = EndedLink(), 2, 0
    source.threads, source.rendezvous = 1, ""
    return source


def test_with_several_ranks_a_dead_generator_stops_the_run_saying_how_to_resume():
    """The generators of several ranks gather each step's rows among themselves: one restarted alone would wait for
    peers that have moved on, so the rank says what happened and how to continue instead."""
    several = rollouts(rank=1, world_size=2)
    with pytest.raises(UserError, match="generator process of rank 1 ended .exit code -9. having delivered 3 steps"
                                        ".*resume=auto"):
        several._alive_or_restarted()
    assert several.link.spawned == 0

    alone = rollouts(rank=0, world_size=1)
    alone._alive_or_restarted()  # one rank: restarted, and counted (async/generator_restarts)
    assert alone.link.spawned == 1 and alone.restarts == 1
