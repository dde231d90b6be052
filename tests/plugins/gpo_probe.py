"""A test-only plug-in that records, per rank, what the engine did: rows trained after pruning and sharding,
the tracker kind, step metrics, and who called save_pretrained. Imported on every rank through
`plugins=[gpo_probe]`; writes JSON lines to $GPO_PROBE (nothing when unset)."""

from __future__ import annotations

import json
import os

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


def shard(kept, rank, world_size):
    mine = _shard(kept, rank, world_size)
    _record("shard", rows=len(mine), world_size=world_size)
    return mine


def init(self, cfg):
    _init(self, cfg)
    _record("tracker", name=type(self.tracker).__name__)


def step(self):
    metrics = _step(self)
    _record("step", metrics={k: float(v) for k, v in metrics.items()})
    return metrics


def save_pretrained(self, *args, **kwargs):
    _record("save_pretrained", target=str(args[0] if args else kwargs.get("save_directory")))
    return _save(self, *args, **kwargs)


engine.shard, engine.Engine.__init__, engine.Engine.step = shard, init, step
PreTrainedModel.save_pretrained = save_pretrained
