"""What the pruners share: which rows form a group, the unit a quota counts over (`Scope`), how many rows each
unit keeps (`Quota`), a seeded per-row key for ties (`row_keys`), keeping the best rows of each unit (`keep_top`),
and topping a mask up to a multiple of the world size by a pruner's own priority (`top_up`).

`topk`, `random` and `threshold` differ only in the score they rank by; everything here is pure and decides the
same on every rank, because every rank holds the same gathered batch.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal, get_args

import torch
from torch import Tensor

from gpo.errors import UserError
from gpo.quota import kept_per_group
from gpo.schema import Ge, Lt
from gpo.types import RolloutBatch

# The rows one quota competes over:
#   group:  k per question (the paper's description)
#   rank:   k x (questions of that rank) over the rows each rank generated (the CPPO open-r1 code)
#   global: k x (all questions) over the whole step (the CPPO verl code)
Scope = Literal["group", "rank", "global"]
SCOPES: tuple[str, ...] = get_args(Scope)

# `row_keys` packs the seed into 8 signed bytes.
Seed = Annotated[int, Ge(-(2**63)), Lt(2**63)]


def row_keys(batch: RolloutBatch, seed: int) -> Tensor:
    """A pseudo-random int64 per row from the seed and the row's real tokens (padding ignored).

    Identical on every rank and for any world size (it depends on neither padding width nor row position),
    and different from step to step because the completions differ.
    """
    keys = []
    for i in range(len(batch)):
        h = hashlib.blake2b(digest_size=8)
        h.update(seed.to_bytes(8, "little", signed=True))
        h.update(batch.prompt_ids[i][batch.prompt_mask[i].bool()].to(torch.int64).cpu().numpy().tobytes())
        h.update(b"|")
        h.update(batch.completion_ids[i][batch.completion_mask[i].bool()].to(torch.int64).cpu().numpy().tobytes())
        keys.append(int.from_bytes(h.digest(), "little") >> 1)  # 63 bits: fits a non-negative int64
    return torch.tensor(keys, dtype=torch.int64)  # [N]


def keep_top(score: Tensor, key: Tensor, segment: Tensor, quota: Tensor) -> Tensor:
    """bool [N]: in each segment s, the quota[s] rows with the largest score; equal scores go by smaller key.

    score [N] float, key [N] int64, segment [N] long in 0..S-1, quota [S] long. Rows with equal score and key
    (identical tokens) go by row order. Pure: three stable sorts give (segment, -score, key, index) order.
    """
    order = torch.argsort(key, stable=True)  # [N]
    order = order[torch.argsort(-score[order], stable=True)]
    order = order[torch.argsort(segment[order], stable=True)]
    sorted_segment = segment[order]
    starts = torch.searchsorted(sorted_segment, sorted_segment, right=False)  # first sorted position of its segment
    position = torch.arange(len(order)) - starts  # [N] rank within the segment
    keep = torch.zeros(len(order), dtype=torch.bool)
    keep[order] = position < quota[sorted_segment]
    return keep


def top_up(keep: Tensor, priority: Tensor, multiple_of: int) -> Tensor:
    """`keep` plus just enough of the rows it left out, highest `priority` first, that the kept count is a
    multiple of `multiple_of` (the world size, so every rank trains as many rows); `keep` itself when it already
    is (always for multiple_of=1). Equal priorities go by row position (a stable sort), so every rank, holding
    the same gathered batch, adds the same rows.

    keep bool [N], priority [N] (any real or integer dtype). When fewer rows are left out than are missing (the
    batch's N is itself not a multiple), every row is kept and the count stays uneven: `gpo.distributed.shard`
    then says which settings make a step's rows split evenly.
    """
    if multiple_of < 1:
        raise UserError(f"pruner.keep: multiple_of must be >= 1 (the world size), got {multiple_of}.")
    short = -int(keep.sum()) % multiple_of
    left_out = torch.nonzero(~keep).flatten()  # [M]
    if short == 0 or len(left_out) == 0:
        return keep
    best = left_out[torch.argsort(priority[left_out], descending=True, stable=True)[:short]]
    out = keep.clone()
    out[best] = True
    return out


def group_index(batch: RolloutBatch) -> tuple[Tensor, Tensor]:
    """(index [N] in 0..groups-1 in order of appearance, size [groups]), checking that groups are contiguous."""
    ids = batch.group_ids
    if len(ids) == 0:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    starts = torch.ones(len(ids), dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    index = torch.cumsum(starts.long(), 0) - 1  # [N]
    if int(starts.sum()) != len(torch.unique(ids)):
        raise UserError("batch.group_ids: the rows of a question must be contiguous (a group id reappears later).")
    return index, torch.bincount(index)


class Quota:
    """How many rows each segment keeps, for a per-group k (`keep`, else from `rate`) and a scope; shared by
    topk and random. Field ranges and the scope's choices are the config's types, checked by the composer."""

    def __init__(self, rate: float | None, keep: int | None, scope: Scope) -> None:
        if keep is None:
            kept_per_group(1 << 20, rate=rate)  # one of the two must be set: say so before the first batch
        self.rate, self.keep, self.scope = rate, keep, scope

    def per_group(self, group_size: int) -> int:
        return kept_per_group(group_size, rate=self.rate, keep=self.keep)

    def segments(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """(segment [N], quota [S]) for this batch's scope."""
        group, sizes = group_index(batch)
        k = torch.tensor([self.per_group(int(s)) for s in sizes], dtype=torch.long)  # [groups]
        if self.scope == "group":
            return group, k
        if self.scope == "global":
            return torch.zeros(len(batch), dtype=torch.long), k.sum().reshape(1)
        if self.scope == "rank":
            # a group belongs to the rank that generated it; that rank keeps the sum of its groups' k
            first_row = torch.searchsorted(group, torch.arange(len(sizes)))  # [groups]
            group_owner = batch.owner_rank[first_row].long()
            quota = torch.zeros(int(group_owner.max()) + 1, dtype=torch.long).index_add_(0, group_owner, k)
            return batch.owner_rank.long(), quota
        # Only a config built without the composer gets here; the composer rejects other scopes with a suggestion.
        raise UserError(f"pruner.scope must be one of {', '.join(SCOPES)}, got `{self.scope}`.")
