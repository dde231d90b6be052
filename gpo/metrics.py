"""Every metric a training step reports, in one place: what the rollouts were (rewards, advantages, lengths), what
pruning and selection did, the objective's per-micro-batch metrics combined over micro-batches and ranks, the
generator/trainer mismatch and its correction, and the seconds per phase. Metric names are the tracker's keys
(`reward/mean`, `prune/kept_frac`, `select/...`, `mismatch/...`, `correction/...`, `time/...`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import Tensor

from gpo.distributed import all_reduce_values
from gpo.ops import group_index, zero_variance_groups
from gpo.rollout_phases import RoundLedger
from gpo.types import Objective, RolloutBatch, StepTotals, loss_mask_of


def rollout_metrics(seen: list[RolloutBatch], candidates: list[tuple[RolloutBatch, Tensor]], spent: RoundLedger,
                    group_size: int, pad_token_id: int) -> dict[str, float]:
    """A step's rollouts: `seen` every round's whole groups (before the group filter), `candidates` each round's
    filtered groups with the pruner's mask, `spent` what selection generated."""
    G = group_size
    full = RolloutBatch.concat(seen, pad_token_id)
    out = {f"reward/{k}_mean": float(v.mean()) for k, v in full.reward_components.items()}
    out.update({f"reward/{k}_std": float(v.std()) if len(v) > 1 else 0.0 for k, v in full.reward_components.items()})
    if len(full):  # a step whose selector skipped every question has no whole group to describe
        out.update(advantage_metrics(full.rewards.view(-1, G), full.advantages.view(-1, G)))
    out["reward/mean"] = float(full.rewards.mean()) if len(full) else float("nan")
    out["completion/length_mean"] = float(full.lengths.float().mean()) if len(full) else 0.0
    out["completion/truncated_frac"] = float(full.truncated.float().mean()) if len(full) else 0.0
    batch = RolloutBatch.concat([b for b, _ in candidates], pad_token_id)
    keep = torch.cat([k for _, k in candidates])
    out.update(prune_metrics(batch, keep) if len(batch) else {"prune/kept_frac": 0.0})
    out["filter/kept_groups_frac"] = len(batch) / max(len(full), 1)
    useful = sum(int((b.advantages[k].abs() > 0).sum()) for b, k in candidates)  # trained rows with signal
    out.update(selection_metrics(spent, G, useful))  # tokens/generated counts screened-out rows too
    return out


def advantage_metrics(rewards: Tensor, advantages: Tensor) -> dict[str, float]:
    """Logged after advantages are computed: [B, G] rewards and advantages -> scalars.

    Stds here are over all B*G values (Bessel-corrected); `zero_std_frac` is the share of groups (not rows)
    whose rewards are all equal.
    """
    adv = advantages.detach().to(torch.float64).flatten()  # [N]
    rew = rewards.detach().to(torch.float64).flatten()  # [N]

    def std(x: Tensor) -> float:
        return x.std().item() if x.numel() > 1 else 0.0

    return {
        "adv/mean": adv.mean().item(),
        "adv/std": std(adv),
        "adv/abs_mean": adv.abs().mean().item(),
        "zero_std_frac": zero_variance_groups(rewards).to(torch.float64).mean().item(),
        "reward/mean": rew.mean().item(),
        "reward/std": std(rew),
    }


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


def selection_metrics(total: RoundLedger, group_size: int, useful_rows: int) -> dict[str, float]:
    """Step metrics of selection: questions considered / skipped / screened out, completions generated against the
    G-per-question baseline, tokens saved (the missing completions at this step's mean length), zero-variance
    shares before selection (every question that got rollouts, on all its rows) and after (the whole groups), and
    generated tokens per trained row with non-zero advantage (`useful_rows`)."""
    baseline = total.considered * group_size
    mean_length = total.tokens / total.completions if total.completions else 0.0
    out = {
        "select/considered": float(total.considered),
        "select/skipped": float(total.skipped),
        "select/screened": float(total.screened),
        "select/screened_out": float(total.screened_out),
        "select/completions": float(total.completions),
        "select/completions_baseline": float(baseline),
        "select/completions_frac": total.completions / baseline if baseline else 0.0,
        "select/tokens_saved_est": (baseline - total.completions) * mean_length,
        "select/zero_var_before": total.zero_var_generated / total.generated_questions
        if total.generated_questions else 0.0,
        "select/zero_var_after": total.zero_var_groups / total.groups if total.groups else 0.0,
        "tokens/generated": float(total.tokens),
        "select/generation_calls": float(total.calls),  # a call shared by two rounds' phases counts once
    }
    out["select/useful_rows"] = float(useful_rows)  # summed over steps by the study table
    if useful_rows:  # a step that trained on no row with signal has no such ratio (no inf in the tracker)
        out["tokens/generated_per_useful_row"] = total.tokens / useful_rows
    return out


def tool_metrics(sums: dict[str, float]) -> dict[str, float]:
    """A multi-turn step's tool use from its sums over calls and ranks (`gpo.agent.Trajectories.metrics`): per
    trajectory means, shares, and the step's totals of failures, seconds in tools and calls per tool."""
    n = sums.get("tool/trajectories", 0.0)
    if not n:
        return {}
    calls, model, inserted = sums["tool/calls"], sums["tool/model_tokens"], sums["tool/tool_tokens"]
    out = {
        "tool/trajectories": n,
        "tool/calls_per_trajectory": calls / n,
        "tool/calling_share": sums["tool/calling"] / n,  # trajectories with at least one call
        "tool/failures": sums["tool/failures"],
        "tool/failure_rate": sums["tool/failures"] / calls if calls else 0.0,
        "tool/turns_per_trajectory": sums["tool/turns"] / n,
        "tool/model_tokens_per_trajectory": model / n,
        "tool/tool_tokens_per_trajectory": inserted / n,
        "tool/tool_token_share": inserted / (model + inserted) if model + inserted else 0.0,
        "tool/seconds": sums["tool/seconds"],
    }
    out.update({k: v for k, v in sums.items() if k.startswith("tool/calls/")})
    return out


def staleness_metrics(staleness: Tensor, max_staleness: int) -> dict[str, float]:
    """async/*: how many policy versions old the weights that sampled the step's rows were (0 in lockstep). The
    share of rows at each staleness 0..k (`async/staleness_d`), its mean and maximum, and the rows dropped for
    exceeding train.max_staleness (never trained)."""
    n = max(len(staleness), 1)
    within = staleness[staleness <= max_staleness]
    out = {f"async/staleness_{d}": float((within == d).sum()) / n for d in range(max_staleness + 1)}
    out["async/staleness_mean"] = float(within.float().mean()) if len(within) else 0.0
    out["async/staleness_max"] = float(within.max()) if len(within) else 0.0
    out["async/dropped_rows"] = float(len(staleness) - len(within))
    return out


def mismatch_metrics(counts: dict[str, float]) -> dict[str, float]:
    """The step's generator/trainer mismatch and what the correction did, from `gpo.step_math.mismatch_counts` summed
    (maxima: maxed) over micro-batches and ranks; {} for a step without the generator's log-probs.

    mismatch/logp_abs_mean, _max: |log pi_old - log pi_generator| over loss tokens; mismatch/kl_gen_train: the mean k3
    estimate of KL(pi_generator || pi_old) per loss token (>= 0); correction/weight_mean: the mean weight of the tokens
    left in the loss; correction/truncated_frac, masked_frac: shares of loss tokens truncated, dropped;
    correction/truncated_seq_frac, masked_seq_frac: shares of rows with any such token (at sequence level: the rows
    truncated or dropped whole)."""
    if not counts:
        return {}
    tokens, rows = max(counts["tokens"], 1.0), max(counts["rows"], 1.0)
    return {
        "mismatch/logp_abs_mean": counts["logp_abs_sum"] / tokens,
        "mismatch/logp_abs_max": counts["logp_abs_max"],
        "mismatch/kl_gen_train": counts["kl_sum"] / tokens,
        "correction/weight_mean": counts["weight_sum"] / max(counts["left"], 1.0),
        "correction/truncated_frac": counts["truncated"] / tokens,
        "correction/masked_frac": counts["masked"] / tokens,
        "correction/truncated_seq_frac": counts["truncated_rows"] / rows,
        "correction/masked_seq_frac": counts["masked_rows"] / rows,
    }


class PhaseTimer:
    """Seconds per phase of a step (generate / reward / logprobs / update), summed over refill rounds."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[phase] += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = time.perf_counter() - self.start
        return out


def entropy_share(entropy: Tensor, batch: RolloutBatch, objective: Objective, totals: StepTotals) -> float:
    """This micro-batch's share of `policy/entropy`, the mean token entropy [N, L] over the step's loss tokens: its
    counted loss tokens' entropy summed, over the step's token total, so MetricSums' sum over micro-batches and
    ranks gives a token-weighted mean (tool tokens and padding are never in the loss mask)."""
    counted = batch.counted(loss_mask_of(objective, batch)).to(entropy.device)  # [N, L]
    return float((entropy * counted).sum()) / max(totals.tokens, 1)


class MetricSums:
    """Combines the objective's per-micro-batch metric shares: summed, except `_min`/`_max` names."""

    COMBINE: ClassVar[dict[str, Callable[[float, float], float]]] = {"sum": lambda a, b: a + b, "min": min, "max": max}

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    @staticmethod
    def reduction(key: str) -> str:
        """How a metric combines over micro-batches and ranks: "min", "max" (by its name's suffix) or "sum"."""
        return key.rsplit("_", 1)[-1] if key.endswith(("_min", "_max")) else "sum"

    def add(self, metrics: dict[str, Any]) -> None:
        for k, v in metrics.items():
            v = float(v)
            self.values[k] = self.COMBINE[self.reduction(k)](self.values[k], v) if k in self.values else v

    def result(self, passes: int) -> dict[str, float]:
        """The whole step's values: each rank holds its share of the global loss and metrics, so they are summed
        (min/max taken) over ranks too; sums are then averaged over the mu passes."""
        out: dict[str, float] = {}
        for op in self.COMBINE:
            out.update(all_reduce_values({k: v for k, v in self.values.items() if self.reduction(k) == op}, op))
        return {k: v / passes if self.reduction(k) == "sum" else v for k, v in out.items()}
