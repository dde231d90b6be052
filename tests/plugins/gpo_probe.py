"""A test-only plug-in that records, per rank, what the engine did: rows trained after pruning and sharding,
the tracker kind, step metrics, and who called save_pretrained. Imported on every rank through
`plugins=[gpo_probe]`; writes JSON lines to $GPO_PROBE (nothing when unset). With $GPO_PROBE_DIR set it also saves
each rank's trained rows per step (`rows-rank{r}-step{n}.pt`) and rank 0's weights after each step
(`version-{n + 1}.pt`), for checks that recompute log-probs under a given version."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

import gpo.engine as engine


def _record(kind: str, **fields) -> None:
    path = os.environ.get("GPO_PROBE")
    if not path:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(path, "a") as f:  # one short line per append: atomic enough between two ranks
        f.write(json.dumps({"kind": kind, "rank": rank, **fields}) + "\n")


_shard, _init, _step, _save = engine.shard, engine.Engine.__init__, engine.Engine.step, PreTrainedModel.save_pretrained


_steps_sharded = 0


def _saved(name: str, value) -> None:
    folder = os.environ.get("GPO_PROBE_DIR")
    if folder:
        torch.save(value, Path(folder) / name)


def shard(kept, rank, world_size):
    global _steps_sharded
    mine = _shard(kept, rank, world_size)
    _record("shard", rows=len(mine), world_size=world_size)
    _saved(f"rows-rank{rank}-step{_steps_sharded}.pt", mine)
    _steps_sharded += 1
    return mine


def init(self, cfg):
    _init(self, cfg)
    _record("tracker", name=type(self.tracker).__name__)


def step(self):
    metrics = _step(self)
    _record("step", metrics={k: float(v) for k, v in metrics.items()})
    if not dist.is_initialized() or dist.get_rank() == 0:
        _saved(f"version-{self.step_index}.pt", self.policy.state_dict())  # serialised now: later steps leave it
    return metrics


def save_pretrained(self, *args, **kwargs):
    _record("save_pretrained", target=str(args[0] if args else kwargs.get("save_directory")))
    return _save(self, *args, **kwargs)


engine.shard, engine.Engine.__init__, engine.Engine.step = shard, init, step
PreTrainedModel.save_pretrained = save_pretrained
