"""Multi-rank helpers: no-ops on one process, even sharding, the top-up to a multiple of the world size (a real
2-process gloo run of gather -> prune -> shard: tests/integration/test_distributed_ranks.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpo import distributed, registry
from gpo.errors import UserError
from gpo.pruners.ranking import top_up
from kit import full_batch, make_batch

registry.load_builtins()


def test_single_process_is_a_no_op():
    assert distributed.world() == (0, 1)
    assert distributed.all_reduce_sum(3) == 3
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(distributed.all_reduce_sum(x), x)
    batch = dataclasses.replace(full_batch(), owner_rank=torch.full((16,), 5))
    gathered = distributed.all_gather_batch(batch, pad_token_id=0)
    assert torch.equal(gathered.completion_ids, batch.completion_ids)
    assert gathered.owner_rank.tolist() == [0] * 16


def test_shard_splits_evenly_in_order():
    batch = make_batch([0.0] * 6, group_size=3)
    shares = [distributed.shard(batch, r, 2).completion_ids[:, 0].tolist() for r in range(2)]
    assert shares == [[100, 101, 102], [103, 104, 105]]  # 6 rows / 2 ranks: contiguous halves
    assert distributed.shard(batch, 0, 1).completion_ids[:, 0].tolist() == list(range(100, 106))


def test_shard_uneven_is_a_user_error():
    with pytest.raises(UserError, match="7 kept completions cannot be split evenly over 2 ranks"):
        distributed.shard(make_batch([0.0] * 7, group_size=7), 0, 2)


def test_top_up_adds_the_best_left_out_rows():
    score = full_batch().advantages.abs()
    keep = registry.get("pruner", "threshold").build({"gamma": 0.95}).keep(full_batch())
    assert torch.nonzero(keep).flatten().tolist() == [0, 8, 9, 10, 11]  # |A| = 1.5, 1, 1, 1, 1
    # 5 rows over 2 ranks: one more, the best left out: |A| 0.9 at rows 13 and 14, the tie goes to position 13.
    assert torch.nonzero(top_up(keep, score, 2)).flatten().tolist() == [0, 8, 9, 10, 11, 13]
    # 5 over 4 ranks: three more (0.9, 0.9, then the first 0.5 at row 1)
    assert torch.nonzero(top_up(keep, score, 4)).flatten().tolist() == [0, 1, 8, 9, 10, 11, 13, 14]
    even = top_up(keep, score, 2)
    assert top_up(keep, score, 1) is keep  # one process, or already even: unchanged
    assert top_up(even, score, 2) is even
    # the threshold pruner tops up itself, by the same |A|
    threshold = registry.get("pruner", "threshold").build({"gamma": 0.95})
    for world_size in (1, 2, 4):
        assert torch.equal(threshold.keep(full_batch(), multiple_of=world_size),
                           top_up(keep, score, world_size))
