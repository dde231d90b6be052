"""A test-only plug-in that injects faults into a run, chosen by environment variables (nothing when unset):

- GPO_FAULT_KILL="RANK:STEP": rank RANK SIGKILLs itself in the middle of step STEP (1-based), after generation and
  rewards, right before the update's collectives, so the other ranks are left waiting on a dead peer.
- GPO_FAULT_HANG="RANK:STEP": the same rank instead stops answering (sleeps), as a rank stuck in I/O would.

Imported on every rank through `plugins=[gpo_faults]`.
"""

from __future__ import annotations

import os
import signal
import time

import gpo.engine as engine

_update = engine.Engine._update


def _due(variable: str, rank: int, step: int) -> bool:
    spec = os.environ.get(variable)
    if not spec:
        return False
    want_rank, want_step = (int(x) for x in spec.split(":"))
    return rank == want_rank and step == want_step


def update(self, kept, *rest):
    step = self.step_index + 1  # step_index counts finished steps
    if _due("GPO_FAULT_KILL", self.rank, step):
        print(f"gpo_faults: rank {self.rank} kills itself in step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if _due("GPO_FAULT_HANG", self.rank, step):
        print(f"gpo_faults: rank {self.rank} hangs in step {step}", flush=True)
        time.sleep(3600)
    return _update(self, kept, *rest)


engine.Engine._update = update
