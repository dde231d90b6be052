"""`topk`: CPPO's completion pruning (Lin et al., "CPPO: Accelerating the Training of Group Relative Policy
Optimization-Based Reasoning Models", arXiv 2503.22342).

Relative to GRPO: after advantages are known, only the k completions with the largest |A| go on to the old-policy,
reference and policy passes; the rest are dropped before any forward pass. Advantages are not changed: kept rows
keep the A computed over the full group.

What differs from the paper's code (reference section 8): k is an integer validated up front (no `int(G*(1-P))`
truncation); the unit it counts over is an explicit `scope` decided on the gathered batch, so `group` and `global`
do not depend on the number of ranks; ties break by a seeded per-row key, never by `torch.topk`'s order.

The selection primitives here (`row_keys`, `keep_top`, `Quota`) are shared with the `random` and `threshold`
pruners, which differ only in the score they rank by.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from enum import Enum

import torch
from torch import Tensor

from gpo.errors import UserError
from gpo.registry import register
from gpo.types import RolloutBatch

# The rows one top-k competes over; an Enum so the config composer rejects a misspelt scope before any run.
#   group:  k per question (the paper's description)
#   rank:   k x (questions of that rank) over the rows each rank generated (the CPPO open-r1 code)
#   global: k x (all questions) over the whole step (the CPPO verl code)
class _Choice(str, Enum):
    def __repr__(self) -> str:  # `gpo list` shows 'group', not <Scope.group: 'group'>
        return repr(self.value)


Scope = _Choice("Scope", {"group": "group", "rank": "rank", "global": "global"})  # functional: `global` is a keyword
SCOPES = tuple(s.value for s in Scope)


@dataclass
class TopKConfig:
    rate: float | None = 0.75  # P, the fraction pruned per group: k = G - round(G*P) kept
    keep: int | None = None  # k kept per group; when set it replaces `rate`
    scope: Scope = Scope["group"]  # group | rank | global, see Scope
    seed: int = 0  # tie-break key; combined with each row's tokens so it changes from step to step


def kept_per_group(group_size: int, rate: float | None = None, keep: int | None = None) -> int:
    """k, the completions kept per group of `group_size`: `keep` if given, else G - round(G*P) (half rounds up).

    G*P is computed on the rate as written, in decimal: in binary floating point 50 * 0.29 is 14.4999..., which
    rounds to 14 where the rule gives round(14.5) = 15. `str(rate)` is the shortest decimal that reads back as
    the same float, i.e. what the user wrote. Raises a UserError instead of truncating when k falls outside 1..G.
    """
    if keep is not None:
        k = keep
        what = f"keep={keep}"
    elif rate is not None:
        if not 0.0 <= rate < 1.0:
            raise UserError(f"pruning rate P must be in [0, 1), got {rate}: P=1 would prune every completion.")
        pruned = (group_size * Decimal(str(rate))).quantize(Decimal(1), rounding=ROUND_HALF_UP)
        k = group_size - int(pruned)
        what = f"rate={rate} (k = {group_size} - round({group_size}*{rate}) = {k})"
    else:
        raise UserError("set either `keep` (completions kept per group) or `rate` (fraction pruned, P).")
    if not 0 < k <= group_size:
        raise UserError(
            f"{what} keeps {k} of a group of {group_size}; it must keep between 1 and {group_size}. "
            f"Choose a smaller rate or a keep in 1..{group_size}."
        )
    return k


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
    """How many rows each segment keeps, for a per-group k and a scope; shared by topk and random."""

    def __init__(self, rate: float | None, keep: int | None, scope: Scope | str) -> None:
        if scope not in SCOPES:
            raise UserError(f"pruner.scope must be one of {', '.join(SCOPES)}, got `{scope}`.")
        if keep is not None and keep < 1:
            raise UserError(f"pruner.keep must be >= 1 completion per group, got {keep}.")
        if keep is None:
            kept_per_group(1 << 20, rate=rate)  # checks that rate is set and in [0, 1) before the first batch
        self.rate, self.keep, self.scope = rate, keep, Scope(scope)

    def per_group(self, group_size: int) -> int:
        return kept_per_group(group_size, rate=self.rate, keep=self.keep)

    def segments(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """(segment [N], quota [S]) for this batch's scope."""
        group, sizes = group_index(batch)
        k = torch.tensor([self.per_group(int(s)) for s in sizes], dtype=torch.long)  # [groups]
        if self.scope is Scope["group"]:
            return group, k
        if self.scope is Scope["global"]:
            return torch.zeros(len(batch), dtype=torch.long), k.sum().reshape(1)
        # rank: a group belongs to the rank that generated it; that rank keeps the sum of its groups' k
        first_row = torch.searchsorted(group, torch.arange(len(sizes)))  # [groups]
        group_owner = batch.owner_rank[first_row].long()
        return batch.owner_rank.long(), torch.zeros(int(group_owner.max()) + 1, dtype=torch.long).index_add_(
            0, group_owner, k
        )


@register("pruner", "topk", config=TopKConfig)
class TopKPruner:
    """Keep the k completions with the largest |advantage| per group, rank or step (CPPO)."""

    def __init__(self, cfg: TopKConfig) -> None:
        self.cfg = cfg
        self.quota = Quota(cfg.rate, cfg.keep, cfg.scope)

    def keep(self, batch: RolloutBatch) -> Tensor:
        segment, quota = self.quota.segments(batch)
        return keep_top(batch.advantages.abs().float().cpu(), row_keys(batch, self.cfg.seed), segment, quota)

    def expected_kept_per_group(self, group_size: int) -> float:
        return float(self.quota.per_group(group_size))
