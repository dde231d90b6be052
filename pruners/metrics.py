"""What a pruning decision did, for the tracker; the engine calls `prune_metrics` whatever the pruner."""

from __future__ import annotations

import torch
from torch import Tensor

from gpo.pruners.ranking import group_index
from gpo.types import RolloutBatch


def _mean(x: Tensor) -> float:
    return float(x.mean()) if len(x) else float("nan")  # nan, not 0: "no rows" is not "rows with |A| = 0"


def prune_metrics(batch: RolloutBatch, keep: Tensor) -> dict[str, float]:
    """Kept fraction, mean |A| of kept and pruned rows, and kept completions per group (min/mean/max)."""
    keep = keep.bool().cpu()
    abs_adv = batch.advantages.abs().float().cpu()  # [N]
    group, _ = group_index(batch)
    kept_per_group = torch.zeros(int(group.max()) + 1 if len(group) else 0).index_add_(0, group, keep.float())
    out = {
        "prune/kept_frac": _mean(keep.float()),
        "prune/abs_adv_kept": _mean(abs_adv[keep]),
        "prune/abs_adv_pruned": _mean(abs_adv[~keep]),
    }
    if len(kept_per_group):
        out |= {
            "prune/kept_per_group_min": float(kept_per_group.min()),
            "prune/kept_per_group_mean": float(kept_per_group.mean()),
            "prune/kept_per_group_max": float(kept_per_group.max()),
        }
    else:
        out |= {f"prune/kept_per_group_{s}": float("nan") for s in ("min", "mean", "max")}
    return out
