"""The study's figures (PNG, drawn on a bare matplotlib Figure: no pyplot, no display, no global backend).

Spread is always shown: a group of replicates is drawn as its mean with a band from the lowest to the highest
seed (reward vs time) or with 95% t-interval error bars (accuracy vs speed-up, the pruning-rate panels).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpo.study.stats import Interval
from gpo.tracking_store import RunRecord

PLOTS = ("reward_vs_time.png", "accuracy_vs_speedup.png")
RATE_PLOT = "rates.png"
# The curve over training time, by preference, with its axis label and title: the first that every run logged.
# Objectives shape `reward/mean` differently (DAPO's overlong penalty), so it is drawn only when no run logged the
# task's own measures, and then says so.
CURVES = {
    "reward/success_rate": ("success rate (reward/success_rate: share of completions the task marks right)",
                         "Success rate vs wall-clock time"),
    "reward/task_mean": ("task reward before shaping (reward/task_mean)", "Task reward vs wall-clock time"),
    "reward/mean": ("shaped reward (reward/mean; objectives shape it differently)",
                    "Shaped reward vs wall-clock time (no run logged the task's success rate)"),
}


def _figure(width: float = 7, height: float = 4.5) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def curve_metric(records: Sequence[RunRecord]) -> str:
    """The first of CURVES that every run with step times logged (reward/mean when none is shared)."""
    timed = [r for r in records if r.history.get("time/step")]
    return next((k for k in CURVES if timed and all(r.history.get(k) for r in timed)), "reward/mean")


def _curve(r: RunRecord, metric: str) -> dict[int, tuple[float, float]]:
    """step -> (seconds of training at the step's end, the metric)."""
    times = dict(r.history.get("time/step", []))
    points = [(s, v) for s, v in r.history.get(metric, []) if s in times]
    elapsed = itertools.accumulate(times[s] for s, _ in points)
    return {s: (t, v) for (s, v), t in zip(points, elapsed)}


def reward_vs_time(records: Sequence[RunRecord], path: Path) -> Path:
    """The task's success rate (else its reward before shaping, see CURVES) against training time, per group."""
    metric = curve_metric(records)
    fig = _figure()
    ax = fig.add_subplot()
    order = list(dict.fromkeys(r.group for r in records))
    for i, group in enumerate(order, start=1):
        curves = [c for c in (_curve(r, metric) for r in records if r.group == group) if c]
        if not curves:
            continue
        steps = sorted(set.intersection(*[set(c) for c in curves]))  # steps every seed reached
        x = [sum(c[s][0] for c in curves) / len(curves) for s in steps]
        ys = [[c[s][1] for c in curves] for s in steps]
        label = f"{i}. {group}" + (f" (mean of {len(curves)} seeds, band min-max)" if len(curves) > 1 else "")
        (line,) = ax.plot(x, [sum(y) / len(y) for y in ys], marker="o", markersize=3, label=label)
        if len(curves) > 1:
            ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("training time (s, sum of step times; mean over seeds)")
    ax.set_ylabel(CURVES[metric][0])
    ax.set_title(CURVES[metric][1])
    if ax.has_data():
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no step metrics logged", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path)
    return path


def _error(interval: Interval) -> list[list[float]] | None:
    if interval.centre is None or interval.low is None or interval.high is None:
        return None
    return [[interval.centre - interval.low], [interval.high - interval.centre]]


def accuracy_vs_speedup(rows: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]], path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    runs = [r for r in rows if r["speedup"] is not None and r["acc_after"] is not None]
    ax.scatter([r["speedup"] for r in runs], [r["acc_after"] for r in runs], s=12, color="grey", alpha=0.5,
               label="single runs")
    for i, g in enumerate(summary, start=1):
        speed, acc = g["speedup"], g["acc_after"]
        if speed.centre is None or acc.centre is None:
            continue
        ax.errorbar(speed.centre, acc.centre, xerr=_error(speed), yerr=_error(acc), fmt="o", capsize=3)
        ax.annotate(f"{i}. {g['group']}", (speed.centre, acc.centre), fontsize="small", textcoords="offset points",
                    xytext=(4, 4))
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)  # the baseline
    ax.set_ylim(-0.05, 1.05)
    ax.margins(x=0.25)
    ax.set_xlabel("speed-up vs baseline (x; error bars: 95% CI over seeds)")
    ax.set_ylabel("eval/after/accuracy")
    ax.set_title("Accuracy vs speed-up")
    if not runs:
        ax.text(0.5, 0.5, "no finished run with an accuracy after training", ha="center", va="center",
                transform=ax.transAxes)
    fig.savefig(path)
    return path


def rates(table: Sequence[dict[str, Any]], accuracy_key: str, path: Path) -> Path:
    """Accuracy and speed-up against the pruning rate, with 95% CI error bars; one line per setting the grid varies
    besides the rate (e.g. allocator=static and allocator=dynamic), so points of different settings are not joined."""
    series: dict[str, list[dict[str, Any]]] = {}
    for row in table:  # rows come sorted by rate
        series.setdefault(_without_rate(row["group"]), []).append(row)
    fig = _figure(10, 4)
    left, right = fig.subplots(1, 2)
    for ax, key, label in ((left, accuracy_key, accuracy_key), (right, "speedup", "speed-up vs baseline (x)")):
        for i, (name, rows) in enumerate(series.items()):
            points = [(row["rate"], row[key]) for row in rows if row[key].centre is not None]
            for rate, value in points:
                ax.errorbar(rate, value.centre, yerr=_error(value), fmt="o", capsize=3, color=f"C{i}")
            ax.plot([p for p, _ in points], [v.centre for _, v in points], color=f"C{i}", alpha=0.5,
                    label=name if len(series) > 1 else None)
        ax.set_xlabel("pruning rate P")
        ax.set_ylabel(label)
    if len(series) > 1:
        left.legend(fontsize=8)
    left.set_title("Accuracy by pruning rate")
    right.set_title("Speed-up by pruning rate")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    fig.savefig(path)
    return path


def _without_rate(group: str) -> str:
    """A group's settings other than the pruning rate: the series a point of the rate plot belongs to."""
    return " ".join(t for t in group.split() if not t.startswith("pruner.rate=")) or "all runs"
