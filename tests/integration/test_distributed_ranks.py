"""Multi-rank helpers in a real 2-process gloo run: gather -> prune -> shard, each pruner's choice the same on every
rank as in one process (the one-process checks: tests/unit/test_distributed.py)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from gpo import distributed, registry
from kit import FULL_ADV, FULL_G, full_batch, make_batch

registry.load_builtins()

G = FULL_G
WORLD = 2
CASES = [("topk", "group"), ("topk", "global"), ("random", "group"), ("random", "global")]


def local_share(rank):
    """What rank `rank` generates: its 2 questions, local group ids 0 and 1, and a padding width of its own."""
    rows = slice(rank * 8, (rank + 1) * 8)
    return make_batch(FULL_ADV[rows], G, tokens=list(range(100 + rank * 8, 108 + rank * 8)), pad=rank * 3,
                      first_prompt=7 + rank * 2)


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
