"""Multi-rank helpers: no-ops on one process, even sharding, and a real 2-process gloo run of
gather -> prune -> shard."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
import torch.multiprocessing as mp

from gpo import distributed, registry
from gpo.errors import UserError
from gpo.pruners.ranking import top_up
from test_pruners import make_batch

registry.load_builtins()

# The fixed step: 4 questions x G=4, with ties (zero-variance group 1, repeated |A| elsewhere).
FULL_ADV = [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 1.0, -1.0, 0.2, -0.9, 0.9, -0.2]
G = 4
WORLD = 2
CASES = [("topk", "group"), ("topk", "global"), ("random", "group"), ("random", "global")]


def full_batch():
    return make_batch(FULL_ADV, G)


def local_share(rank):
    """What rank `rank` generates: its 2 questions, local group ids 0 and 1, and a padding width of its own."""
    rows = slice(rank * 8, (rank + 1) * 8)
    return make_batch(FULL_ADV[rows], G, tokens=list(range(100 + rank * 8, 108 + rank * 8)), pad=rank * 3,
                      first_prompt=7 + rank * 2)


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


def _worker(rank, port, out_dir):
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=WORLD)
    try:
        gathered = distributed.all_gather_batch(local_share(rank), pad_token_id=0)
        result = {"world": distributed.world(), "gathered": gathered,
                  "sum": distributed.all_reduce_sum(rank + 1), "tensor_sum": distributed.all_reduce_sum(
                      torch.tensor([float(rank)]))}
        for name, scope in CASES + [("topk", "rank")]:
            keep = registry.get("pruner", name).build({"keep": 1, "scope": scope}).keep(gathered)
            result[name, scope] = (keep, distributed.shard(gathered.select(keep), rank, WORLD))
        # gamma 0.95 keeps 5 rows; the pruner tops them up to a multiple of the world size by |A|
        keep = registry.get("pruner", "threshold").build({"gamma": 0.95}).keep(gathered, multiple_of=WORLD)
        result["threshold"] = (keep, distributed.shard(gathered.select(keep), rank, WORLD))
        # random, 1 per question of the first 3 questions: 3 rows, one more drawn by the random key
        keep = registry.get("pruner", "random").build({"keep": 1, "scope": "group", "seed": 3}).keep(
            gathered.select(torch.arange(12)), multiple_of=WORLD)
        result["random_top_up"] = keep
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_gather_rebuilds_the_full_step(two_ranks):
    full = full_batch()
    for r, res in enumerate(two_ranks):
        g = res["gathered"]
        assert res["world"] == (r, WORLD)
        assert res["sum"] == 3 and res["tensor_sum"].tolist() == [1.0]  # 1 + 2; 0 + 1
        assert g.group_ids.tolist() == full.group_ids.tolist()  # local 0,1 + 0,1 offset to 0..3
        assert g.owner_rank.tolist() == [0] * 8 + [1] * 8
        assert g.completion_ids.shape == (16, 4)  # rank 1 was 3 columns wider; rank 0 padded to match
        assert torch.equal(g.completion_ids[:, 0], full.completion_ids[:, 0])
        assert torch.equal(g.advantages, full.advantages) and g.truncated.dtype == torch.bool


@pytest.mark.parametrize("name, scope", CASES)
def test_group_and_global_scopes_ignore_world_size(two_ranks, name, scope):
    single = registry.get("pruner", name).build({"keep": 1, "scope": scope}).keep(full_batch())  # world size 1
    kept_ids = full_batch().completion_ids[single, 0].tolist()
    for res in two_ranks:
        assert torch.equal(res[name, scope][0], single)
    shards = [res[name, scope][1] for res in two_ranks]
    assert [len(s) for s in shards] == [2, 2]  # 4 kept (1 per question) split 2 + 2
    assert [t for s in shards for t in s.completion_ids[:, 0].tolist()] == kept_ids


def test_rank_scope_is_top_k_within_each_owner(two_ranks):
    # rank scope on the gathered batch == global scope on each rank's own share (the CPPO open-r1 code)
    expected = torch.cat([
        registry.get("pruner", "topk").build({"keep": 1, "scope": "global"}).keep(local_share(r)) for r in range(WORLD)
    ])
    for res in two_ranks:
        assert torch.equal(res["topk", "rank"][0], expected)


def test_threshold_with_a_varying_count_trains_equal_shares(two_ranks):
    single = registry.get("pruner", "threshold").build({"gamma": 0.95}).keep(full_batch(), multiple_of=2)
    assert torch.nonzero(single).flatten().tolist() == [0, 8, 9, 10, 11, 13]  # the 0.9 at row 13 tops 5 up to 6
    for res in two_ranks:
        assert torch.equal(res["threshold"][0], single)  # every rank adds the same row
    shards = [res["threshold"][1] for res in two_ranks]
    assert [len(s) for s in shards] == [3, 3]
    assert [t for s in shards for t in s.completion_ids[:, 0].tolist()] == \
        full_batch().completion_ids[single, 0].tolist()


def test_random_top_up_is_the_same_on_every_rank(two_ranks):
    three_questions = full_batch().select(torch.arange(12))
    pruner = registry.get("pruner", "random").build({"keep": 1, "scope": "group", "seed": 3})
    single = pruner.keep(three_questions, multiple_of=WORLD)
    assert int(single.sum()) == 4 and int(pruner.keep(three_questions).sum()) == 3
    for res in two_ranks:
        assert torch.equal(res["random_top_up"], single)
