"""What the pruners share: the unit a quota counts over (`Scope`), a seeded per-row key for ties (`row_keys`),
keeping the best rows of each unit (`keep_top`), topping a mask up to a multiple of the world size by a pruner's
own priority (`top_up`), and the |advantage| score (`advantage_magnitude`).

`topk` and `random` keep k rows per unit and differ only in what they rank by: both are a `QuotaPruner` with a
`QuotaConfig` (rate -> k of G, scope, seed) and their own `ranking`. `threshold` keeps a data-dependent count and
shares the key, `keep_top` for its floor, `top_up` and the score. Everything here is pure and decides the same
on every rank, because every rank holds the same gathered batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch import Tensor

from gpo.errors import UserError
from gpo.ops import group_index
from gpo.quota import kept_per_group
from gpo.run_config import RunConfig
from gpo.schema import Ge, Lt, PositiveInt, Rate
from gpo.types import RolloutBatch

# The rows one quota competes over:
#   group:  k per question (the paper's description)
#   rank:   k x (questions of that rank) over the rows each rank generated (the CPPO open-r1 code)
#   global: k x (all questions) over the whole step (the CPPO verl code)
Scope = Literal["group", "rank", "global"]

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
        h.update(batch.completion_ids[i][batch.attended[i].bool()].to(torch.int64).cpu().numpy().tobytes())
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


@dataclass(frozen=True)
class QuotaConfig:
    """Settings of a pruner that keeps k rows per group, rank or step (topk, random): k from `keep`, else from
    `rate` (gpo.quota.kept_per_group), counted over `scope`, ties broken by the seeded per-row key."""

    rate: Rate | None = 0.75  # P, the fraction pruned per group: k = G - round(G*P) kept
    keep: PositiveInt | None = None  # k kept per group; when set it replaces `rate`
    scope: Scope = "group"  # group | rank | global, see Scope above
    seed: Seed = 0  # the per-row key's seed; combined with each row's tokens, so it changes from step to step

    def __post_init__(self) -> None:
        # A rule of two fields; each field's own range is its annotation, checked by the composer.
        if self.rate is None and self.keep is None:
            raise UserError("set either `pruner.keep` (completions kept per group) or `pruner.rate` (the fraction "
                            "pruned, P); both are null.")

    def check_run(self, run: RunConfig) -> None:
        """k of a group of train.group_size must be in 1..G."""
        G = run.train.group_size
        try:
            kept_per_group(G, rate=self.rate, keep=self.keep)
        except UserError as exc:
            raise UserError(f"`pruner.{'keep' if self.keep is not None else 'rate'}` with train.group_size={G}: "
                            f"{exc}") from None


class QuotaPruner:
    """Keeps the k best rows per group, rank or step (`QuotaConfig`): a subclass says only what "best" is.

    `ranking` gives each row a score (the k highest are kept, equal scores by the smaller seeded key) and a
    priority for the rows a top-up to a multiple of the world size adds (highest first, then row order).
    """

    def __init__(self, cfg: QuotaConfig) -> None:
        self.cfg = cfg

    def ranking(self, batch: RolloutBatch, key: Tensor) -> tuple[Tensor, Tensor]:
        """(score [N], top-up priority [N]) of the batch's rows; `key` [N] is `row_keys(batch, cfg.seed)`."""
        raise NotImplementedError

    def keep(self, batch: RolloutBatch, multiple_of: int = 1) -> Tensor:
        key = row_keys(batch, self.cfg.seed)  # [N]
        score, priority = self.ranking(batch, key)
        segment, quota = self.segments(batch)
        return top_up(keep_top(score, key, segment, quota), priority, multiple_of)

    def expected_kept_per_group(self, group_size: int) -> float:
        return float(self.per_group(group_size))

    def per_group(self, group_size: int) -> int:
        return kept_per_group(group_size, rate=self.cfg.rate, keep=self.cfg.keep)

    def segments(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """(segment [N], quota [S]) for this batch's scope."""
        group, sizes = group_index(batch)
        k = torch.tensor([self.per_group(int(s)) for s in sizes], dtype=torch.long)  # [groups]
        if self.cfg.scope == "group":
            return group, k
        if self.cfg.scope == "global":
            return torch.zeros(len(batch), dtype=torch.long), k.sum().reshape(1)
        # rank: a group belongs to the rank that generated it; that rank keeps the sum of its groups' k
        first_row = torch.searchsorted(group, torch.arange(len(sizes)))  # [groups]
        group_owner = batch.owner_rank[first_row].long()
        quota = torch.zeros(int(group_owner.max()) + 1, dtype=torch.long).index_add_(0, group_owner, k)
        return batch.owner_rank.long(), quota


def advantage_magnitude(batch: RolloutBatch) -> Tensor:
    """|A| [N] as float on the CPU: the score of topk and threshold (CPPO ranks completions by it)."""
    return batch.advantages.abs().float().cpu()
