"""The study's tables, built from `RunRecord`s: one row per run, one per group of replicates, one per pruning rate.

    study.csv / study.md        every run; its speed-up is against the baseline run of the same seed
    groups.csv (in study.md)    each combination over its seeds: mean and 95% t interval of accuracy, train time
                                and speed-up, the speed-up and accuracy difference paired by seed, in plain words
    rates.csv / rates.md        a pruning-rate grid in the CPPO paper's layout (rate, k kept of G, accuracy,
                                time, speed-up vs the baseline, tokens generated and trained)
`train_s` sums the per-step times (evaluation and saving excluded); `wall_s` is the whole run.

Runs are compared on what every objective shares: the task's success rate and its own reward, never the shaped total
`reward/mean`, which each objective shapes its own way (DAPO's overlong penalty put its reward/mean near -0.5 where
GRPO's was +0.2 on the same task).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard

from gpo.study.stats import Interval, difference_interval, mean_interval, paired, speedup_interval, t_quantile, verdict
from gpo.tracking_store import PEAK_GPU, PEAK_RSS, RunRecord

RUN_COLUMNS = ["run", "combination", "group", "seed", "baseline", "status", "error", "acc_before", "acc_after",
               "final_success_rate", "final_task_reward", "train_s", "speedup", "kept_frac", "tokens_generated",
               "tokens_trained", "questions_dropped_frac", "completions_frac", "tokens_per_useful_row", "peak_rss_mb",
               "peak_gpu_mb", "wall_s", "run_id"]
# Final evaluation metrics beyond eval/after/accuracy: sampled-evaluation scores and further tasks (eval.tasks).
EXTRA_EVAL = re.compile(r"eval/after/(?:(?P<task>[\w.-]+)/)?(?P<metric>accuracy|(?:pass|avg|maj)_at_\d+)")
FORMATS = {"acc_before": "{:.3f}", "acc_after": "{:.3f}", "final_success_rate": "{:.3f}",
           "final_task_reward": "{:.3f}", "train_s": "{:.1f}",
           "speedup": "{:.2f}x", "kept_frac": "{:.3f}", "tokens_generated": "{:.0f}", "tokens_trained": "{:.0f}",
           "questions_dropped_frac": "{:.3f}", "completions_frac": "{:.3f}", "tokens_per_useful_row": "{:.1f}",
           "peak_rss_mb": "{:.0f}", "peak_gpu_mb": "{:.0f}", "wall_s": "{:.1f}"}
# The step metrics the final columns read, by preference. The mean of the task's pass criterion: runs logged before
# `reward/success_rate` existed have it as `reward/accuracy_mean` (the criterion is `accuracy` unless a task names
# another). The task's reward before any objective's shaping.
SUCCESS_RATE_KEYS = ("reward/success_rate", "reward/accuracy_mean")
TASK_REWARD_KEYS = ("reward/task_mean",)
REWARD_NOTE = ("final_success_rate: the last step's success rate (`reward/success_rate`, or `reward/accuracy_mean` "
               "where a run logged no success rate), the share of its completions that the task's pass criterion "
               "marks right; "
               "final_task_reward: the last step's task reward before any objective's shaping (`reward/task_mean`). "
               "Runs are not compared on the shaped reward (`reward/mean`): objectives shape it differently.")


# --- one row per run ----------------------------------------------------------------------------------------------


def extra_eval_columns(records: Sequence[RunRecord]) -> list[str]:
    """`pass_at_4`, `aime24_accuracy`, ...: every extra final-evaluation metric any run logged, sorted."""
    found = set()
    for r in records:
        for key in r.metrics:
            m = EXTRA_EVAL.fullmatch(key)
            if m and (m["task"] or m["metric"] != "accuracy"):
                found.add(f"{m['task']}_{m['metric']}" if m["task"] else m["metric"])
    return sorted(found)


def _extra_metric(record: RunRecord, column: str) -> float | None:
    for key, value in record.metrics.items():
        m = EXTRA_EVAL.fullmatch(key)
        if m and (f"{m['task']}_{m['metric']}" if m["task"] else m["metric"]) == column:
            return value
    return None


def run_columns(records: Sequence[RunRecord]) -> list[str]:
    at = RUN_COLUMNS.index("acc_after") + 1
    return RUN_COLUMNS[:at] + extra_eval_columns(records) + RUN_COLUMNS[at:]


def _selection_columns(r: RunRecord) -> dict[str, float | None]:
    """Over the run's steps: the share of questions considered that never reached a whole group (skipped or
    screened out by the selector), completions generated / the G-per-question baseline, and generated tokens per
    trained row with non-zero advantage. None for runs that logged no selection metrics."""
    total = {k: sum(v for _, v in r.history.get(f"select/{k}", [])) for k in
             ("considered", "skipped", "screened_out", "completions", "completions_baseline", "useful_rows")}
    generated = sum(v for _, v in r.history.get("tokens/generated", []))
    return {
        "questions_dropped_frac": (total["skipped"] + total["screened_out"]) / total["considered"]
        if total["considered"] else None,
        "completions_frac": total["completions"] / total["completions_baseline"]
        if total["completions_baseline"] else None,
        "tokens_per_useful_row": generated / total["useful_rows"] if total["useful_rows"] else None,
    }


def table(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """One row per run, in the order given; each speed-up is against the baseline run with the same seed (the
    first baseline run when none shares it). Baseline runs are the tagged ones, else the first run's group."""
    extras = extra_eval_columns(records)
    rows: list[dict[str, Any]] = []
    for i, r in enumerate(records, start=1):
        times = [v for _, v in r.history["time/step"]]
        kept = [v for _, v in r.history["prune/kept_frac"]]
        row: dict[str, Any] = {
            "run": i,
            "combination": r.combination or r.name,
            "group": r.group,
            "seed": r.seed,
            "baseline": "",
            "status": r.status,
            "error": r.error,
            "acc_before": r.metrics.get("eval/before/accuracy"),
            "acc_after": r.metrics.get("eval/after/accuracy"),
            **{c: _extra_metric(r, c) for c in extras},
            "final_success_rate": _last(r, SUCCESS_RATE_KEYS),
            "final_task_reward": _last(r, TASK_REWARD_KEYS),
            "train_s": sum(times) if times else None,
            "speedup": None,
            "kept_frac": sum(kept) / len(kept) if kept else None,
            "tokens_generated": sum(v for _, v in r.history["tokens/generated"]) if times else None,
            "tokens_trained": sum(v for _, v in r.history["tokens/trained"]) if times else None,
            **_selection_columns(r),
            "peak_rss_mb": r.metrics.get(PEAK_RSS),
            "peak_gpu_mb": r.metrics.get(PEAK_GPU),
            "wall_s": r.metrics.get("train/seconds"),  # the whole run: evaluation before and after, saving
            "run_id": r.run_id,
        }
        rows.append(row)
    base_rows = [rows[i] for i in baseline_indices(records)]
    for row in base_rows:
        row["baseline"] = "yes"
    for row in rows:
        base = next((b for b in base_rows if b["seed"] == row["seed"]), base_rows[0] if base_rows else None)
        if base is not None and _finished(base) and _finished(row):
            row["speedup"] = base["train_s"] / row["train_s"]
    return rows


def _last(record: RunRecord, keys: Sequence[str]) -> float | None:
    """The latest value of the first of `keys` the run logged (a step metric's latest is its last step's)."""
    return next((record.metrics[k] for k in keys if k in record.metrics), None)


def baseline_indices(records: Sequence[RunRecord]) -> list[int]:
    """The runs speed-ups are measured against: those a study tagged, else the runs of the first run's group."""
    tagged = [i for i, r in enumerate(records) if r.baseline]
    if tagged or not records:
        return tagged
    return [i for i, r in enumerate(records) if r.group == records[0].group]


def _finished(row: dict[str, Any]) -> bool:
    return row["status"] == "FINISHED" and bool(row["train_s"])


# --- one row per group of replicates ------------------------------------------------------------------------------


def groups(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group's runs summarised: means with 95% t intervals; speed-up and accuracy difference paired by seed
    against the baseline group (rows from `table`, which marks the baseline runs)."""
    order = list(dict.fromkeys(r["group"] for r in rows))
    by_group = {g: [r for r in rows if r["group"] == g] for g in order}
    base_group = _baseline_group(rows)
    base = {_key(r): r for r in by_group.get(base_group, []) if _finished(r)}
    extras = [c for c in rows[0] if c not in RUN_COLUMNS] if rows else []
    out = []
    for g in order:
        done = [r for r in by_group[g] if _finished(r)]
        mine = {_key(r): r for r in done}
        time_pairs = paired({s: b["train_s"] for s, b in base.items()}, {s: r["train_s"] for s, r in mine.items()})
        acc_pairs = paired(_values(base, "acc_after"), _values(mine, "acc_after"))
        speed, diff = speedup_interval(time_pairs), difference_interval(acc_pairs)
        is_base = g == base_group
        out.append({
            "group": g,
            "runs": f"{len(done)}/{len(by_group[g])}",
            "acc_after": mean_interval([r["acc_after"] for r in done if r["acc_after"] is not None]),
            **{c: mean_interval([r[c] for r in done if r[c] is not None]) for c in extras},
            "train_s": mean_interval([r["train_s"] for r in done]),
            "speedup": speed,
            "faster": "baseline" if is_base else verdict(speed, 1.0, "faster", "slower"),
            "acc_diff": Interval(0, None) if is_base else diff,
            "accuracy": "baseline" if is_base else verdict(diff, 0.0, "higher", "lower"),
            "tokens_generated": mean_interval([r["tokens_generated"] for r in done]),
            "tokens_trained": mean_interval([r["tokens_trained"] for r in done]),
            "kept_frac": mean_interval([r["kept_frac"] for r in done if r["kept_frac"] is not None]),
        })
    return out


def has_replicates(rows: Sequence[dict[str, Any]]) -> bool:
    return any(sum(r["group"] == g for r in rows) > 1 for g in {r["group"] for r in rows})


def _baseline_group(rows: Sequence[dict[str, Any]]) -> str | None:
    return next((r["group"] for r in rows if r["baseline"]), None)


def _key(row: dict[str, Any]) -> str:
    return str(row["seed"]) if row["seed"] is not None else row["run_id"]


def _values(by_seed: dict[str, dict[str, Any]], column: str) -> dict[str, float]:
    return {s: r[column] for s, r in by_seed.items() if r[column] is not None}


GROUP_INTERVALS = ["acc_after", "train_s", "speedup", "acc_diff", "tokens_generated", "tokens_trained", "kept_frac"]


def group_csv_rows(summary: Sequence[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """Intervals spread into `X`, `X_low`, `X_high` columns (blank without an interval)."""
    columns: list[str] = []
    out = []
    for row in summary:
        flat: dict[str, Any] = {}
        for key, value in row.items():
            if isinstance(value, Interval):
                flat.update({key: value.centre, f"{key}_low": value.low, f"{key}_high": value.high})
            else:
                flat[key] = value
        columns = columns or list(flat)
        out.append(flat)
    return columns, out


# --- a pruning-rate grid, as the CPPO paper tabulates it ----------------------------------------------------------


def pruning_rate(record: RunRecord) -> float | None:
    """P of the run: pruner.rate, or 1 - keep/G, or 0 without pruning; None for pruners with neither."""
    params = record.params
    keep, rate, size = params.get("pruner.keep"), params.get("pruner.rate"), params.get("train.group_size")
    if params.get("pruner.name") == "none":
        return 0.0
    if _given(keep) and _given(size):
        return 1.0 - float(keep) / float(size)
    return float(rate) if _given(rate) else None


def _given(value: str | None) -> TypeGuard[str]:
    return value not in (None, "", "None")


def rate_table(records: Sequence[RunRecord], rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """One row per group, sorted by pruning rate, when the study's groups span two or more rates; else None."""
    summary = {g["group"]: g for g in groups(rows)}
    rate_of: dict[str, float] = {}
    size_of: dict[str, str] = {}
    for r in records:
        rate = pruning_rate(r)
        if rate is not None:
            rate_of.setdefault(r.group, rate)
            size_of.setdefault(r.group, r.params.get("train.group_size", ""))
    if len(set(rate_of.values())) < 2:
        return None
    test_column, split = _accuracy_column(records, rows)
    out = []
    for group, rate in sorted(rate_of.items(), key=lambda kv: kv[1]):
        s = summary[group]
        kept = s["kept_frac"].centre
        G = float(size_of[group]) if size_of[group] else None
        out.append({
            "group": group,
            "rate": rate,
            "kept": f"{kept * G:.3g} of {G:.0f}" if kept is not None and G else "",
            f"accuracy ({split})": s[test_column] if test_column in s else s["acc_after"],
            "train_s": s["train_s"],
            "speedup": s["speedup"],
            "tokens_generated": s["tokens_generated"],
            "tokens_trained": s["tokens_trained"],
            "runs": s["runs"],
        })
    return out


def _accuracy_column(records: Sequence[RunRecord], rows: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """The test-split accuracy when eval.tasks scored the run's own task, else eval/after/accuracy's split."""
    task = next((r.params.get("task.name") for r in records if r.params.get("task.name")), None)
    if task and rows and f"{task}_accuracy" in rows[0]:
        return f"{task}_accuracy", f"{task} test"
    split = next((s for r in records if (s := r.params.get("eval.split"))), "final evaluation")
    return "acc_after", split


# --- writing ------------------------------------------------------------------------------------------------------


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows([{k: "" if row.get(k) is None else row[k] for k in columns} for row in rows])
    return path


def markdown(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(col: str, value: Any) -> str:
        if value is None or value == "":
            return ""
        if isinstance(value, Interval):
            return _interval_text(col, value)
        fmt = FORMATS.get(col, "{:.3f}" if isinstance(value, float) else "{}")
        return fmt.format(value).replace("|", "\\|")

    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(c, row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(out)


def _interval_text(col: str, value: Interval) -> str:
    if value.centre is None:
        return ""
    fmt = {"train_s": "{:.1f}", "speedup": "{:.2f}x", "tokens_generated": "{:.0f}", "tokens_trained": "{:.0f}",
           "acc_diff": "{:+.3f}"}.get(col, "{:.3f}")
    text = fmt.format(value.centre)
    if value.low is not None:
        low, high = (fmt.replace("+", "").rstrip("x").format(v) for v in (value.low, value.high))
        text += f" [{low}, {high}]"
    return text


def interval_note(rows: Sequence[dict[str, Any]]) -> str:
    sizes = sorted({int(g["runs"].split("/")[0]) for g in groups(rows)} - {0, 1})
    t = ", ".join(f"t={t_quantile(n - 1):.2f} for n={n}" for n in sizes)
    return ("Brackets are 95% confidence intervals, t-based (Student's t, n-1 degrees of freedom" + (f"; {t}" if t
            else "") + "). Speed-up: geometric mean of the per-seed ratios baseline time / run time, interval on the "
            "log scale; accuracy difference: run minus baseline, paired by seed.")
