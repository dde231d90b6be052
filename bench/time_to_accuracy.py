"""Time to accuracy: does choosing questions before generation (selector) compose with CPPO's pruning after it?

Arms: grpo, dapo (dynamic sampling), cppo (top-k P=0.75 + dynamic allocator), screen (SPEED-RL), screen+cppo and
screen+dapo on two-digit arith, plus any arm defined on the command line (--arm NAME=ITEM,ITEM,...: each item a
built-in arm, whose settings it takes, or a key=value override; e.g. screen+cppo-p875=screen+cppo,pruner.rate=0.875).
All arms of one seed live in one process and take training steps in turn (the arm with the least training time so
far goes next), so load from other jobs hits them alike; each arm stops when its own summed step time reaches the
budget. Held-out greedy accuracy (validation split) is measured at fixed fractions of the budget, outside the
budgeted time, packed early, where most arms learn the answer format.

The pool. By default (--pool fresh) every arm draws from a pool it cannot exhaust: task.train_size is one pass of an
arm drawing --rate questions a second for the whole budget, about 2.6x the fastest arm seen on a 2-core CPU (screen+
cppo, 1.53 questions/s at B=2), and the notes flag any arm that still made more than two passes. On a fixed pool of
64 the fast arms made up to 23 passes in 960 s against GRPO's 4, peaked early and fell back as they exhausted it, so
the time to GRPO's final accuracy rested on whether an early peak happened to top GRPO's end. History-based
selectors (greso, mopps) need questions to come back: they run apart, with a repeating pool (--pool 64), and are
reported in a section of their own; a fresh-pool run refuses them.

The learning rate follows a cosine over each arm's own budget by default (--schedule): at a constant rate GRPO here
peaks and falls back, so "GRPO's final accuracy" was the low point after its fall. Annealed by time, every arm ends
at a settled point of the same schedule, and an arm that takes faster steps gets more of them.

Reported per arm, median (min-max) over seeds, each seed paired with its own GRPO run: time to GRPO's final held-out
accuracy (as a fraction of GRPO's time to it), final accuracy, accuracy at equal time (the area under the
accuracy-vs-time curve over the budget, and the mean over the marks), generated tokens per useful trained row (a kept
row with non-zero advantage; screened-out rollouts count as generated) and passes over the pool. Targets: the best
arm reaches GRPO's final accuracy in at most 0.33x GRPO's time at the median over seeds and ends no lower at the
median; each arm's tokens per useful row at most 0.5x GRPO's. A missed target is printed as missed, with its numbers.
--save FILE writes every finished seed; the same command again resumes, skipping the seeds the file holds.

    python bench/time_to_accuracy.py --budget 240 --questions 2 --seeds 1 2 3 4 5 --arms grpo cppo screen+cppo \\
        --arm screen+cppo-p875=screen+cppo,pruner.rate=0.875 --save run.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness import add_common, engine, set_lr, table, write_section

PRUNED = 0.75  # CPPO's pruner.rate: a CPPO arm trains a quarter of the rows it generates
CPPO = ["pruner=topk", f"pruner.rate={PRUNED}", "allocator=dynamic"]
DAPO = ["algo=dapo", "pruner=none", "allocator=static", "allocator.max_rounds=3"]
ARMS = {
    "grpo": ["pruner=none", "allocator=static"],
    "dapo": DAPO,
    "cppo": CPPO,
    "screen": ["selector=screen", "pruner=none", "allocator=dynamic"],
    "screen+cppo": ["selector=screen", *CPPO],
    "greso+cppo": ["selector=greso", *CPPO],
    "mopps+cppo": ["selector=mopps", *CPPO],
    # keeps every row of a group that varies, so its tokens per useful row are not bounded below by CPPO's pruning
    "screen+dapo": ["selector=screen", *DAPO],
}
HISTORY = ("greso", "mopps")  # selectors that learn from a question's past rollouts: they need a repeating pool
TIME_TARGET = 0.33  # the best arm's time to GRPO's final accuracy, as a fraction of GRPO's, at the median
ROW_TARGET = 0.5  # generated tokens per useful row, as a fraction of GRPO's, at the median
MAX_PASSES = 2.0  # a fresh pool is too small for an arm that drew more than this many passes over it
FRESH_RATE = 4.0  # questions per second a fresh pool is sized for; see the module docstring


def split_items(text: str) -> list[str]:
    """Split at the commas outside brackets, so an override such as task.operators=[+,-] stays one item."""
    items, depth, current = [], 0, ""
    for ch in text:
        depth += (ch in "[({") - (ch in "])}")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    return [item.strip() for item in [*items, current] if item.strip()]


def parse_arm(spec: str, known: dict[str, list[str]]) -> tuple[str, list[str]]:
    """`NAME=ITEM,ITEM,...` as its name and overrides: an item without `=` names a known arm and brings its
    settings, an item `key=value` is a config override; later items win, as on gpo's command line."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--arm {spec!r}: expected NAME=ITEM,ITEM,... (an arm name or key=value each)")
    if name in known:
        raise ValueError(f"--arm {spec!r}: {name} is already an arm; give the new one a name of its own")
    overrides: list[str] = []
    for item in split_items(rest):
        if "=" in item:
            overrides.append(item)
        elif item in known:
            overrides += known[item]
        else:
            raise ValueError(f"--arm {spec!r}: {item!r} is neither key=value nor an arm ({', '.join(known)})")
    return name, overrides


def arm_overrides(names: Sequence[str], specs: Sequence[str]) -> dict[str, list[str]]:
    """The arms a run measures, built-in ones named in --arms first, then every --arm in its order (an --arm may
    build on one defined before it)."""
    known = dict(ARMS)
    custom = {}
    for spec in specs:
        name, overrides = parse_arm(spec, known)
        known[name] = custom[name] = overrides
    return {**{n: ARMS[n] for n in names}, **custom}


def uses_history(overrides: Sequence[str]) -> bool:
    """Whether an arm's selector learns from a question's past rollouts (the last selector pick wins)."""
    picks = [o.partition("=")[2] for o in overrides if o.partition("=")[0] == "selector"]
    return bool(picks) and picks[-1] in HISTORY


def fresh_pool(budget: float, rate: float) -> int:
    """Questions in a fresh pool: one pass for an arm that draws `rate` questions a second over the whole budget,
    ceil(rate x budget), so an arm up to twice as fast as `rate` stays within two passes."""
    return math.ceil(rate * budget)


def pool_size(pool: int | str, budget: float, rate: float) -> int:
    """task.train_size for --pool: a fixed number, or a fresh pool sized from the budget and rate."""
    return fresh_pool(budget, rate) if pool == "fresh" else int(pool)


def lr_at(seconds: float, budget: float, peak: float, schedule: str) -> float:
    """The learning rate of a step that starts `seconds` into an arm's budget: constant, or a cosine from `peak`
    down to 0 at the end of the budget (by time, not by step: the arms take different numbers of steps)."""
    if schedule == "constant":
        return peak
    return peak * 0.5 * (1 + math.cos(math.pi * min(seconds / budget, 1.0)))


def run_seed(args: argparse.Namespace, seed: int, arms: dict[str, list[str]], pool: int) -> dict[str, dict]:
    common = [f"model.path={args.model}", "task=arith", "task.digits=2", f"task.train_size={pool}",
              "algo=grpo", f"seed={seed}", f"train.steps={args.max_steps}",
              f"train.questions_per_step={args.questions}",
              f"train.max_completion_length={args.max_new}", f"optim.lr={args.lr}", "optim.schedule=constant",
              "optim.warmup_ratio=0", f"eval.limit={args.eval_limit}", f"eval.max_new_tokens={args.max_new}", *args.set]
    engines = {name: engine(*common, *overrides) for name, overrides in arms.items()}
    marks = sorted(args.budget * f for f in args.eval_at)
    start_acc = next(iter(engines.values())).evaluate("t")["eval/t/accuracy"]  # every arm starts from these weights
    state: dict[str, dict[str, Any]] = {  # JSON-shaped, as --save writes it
        name: {"seconds": 0.0, "steps": 0, "tokens": 0.0, "useful": 0.0, "considered": 0.0, "completions": 0.0,
               "pool": pool, "curve": [(0.0, start_acc)], "next_mark": 0} for name in engines}
    while True:
        active = [n for n in engines if state[n]["seconds"] < args.budget and state[n]["steps"] < args.max_steps]
        if not active:
            break
        name = min(active, key=lambda n: state[n]["seconds"])
        s, eng = state[name], engines[name]
        set_lr(eng, lr_at(s["seconds"], args.budget, args.lr, args.schedule))
        metrics = eng.step()
        s["seconds"] += metrics["time/step"]
        s["steps"] += 1
        s["tokens"] += metrics["tokens/generated"]
        s["considered"] += metrics.get("select/considered", 0.0)
        s["completions"] += metrics.get("select/completions", 0.0)
        s["useful"] += metrics.get("select/useful_rows", 0.0)
        crossed = bisect.bisect_right(marks, s["seconds"])  # marks at or before the time now
        if crossed > s["next_mark"]:  # once however many marks this step passed: the same weights, the same point
            s["curve"].append((s["seconds"], eng.evaluate("t")["eval/t/accuracy"]))
            s["next_mark"] = crossed
        print(f"seed {seed} {name}: {s['seconds']:.0f}s step {s['steps']} reward {metrics['reward/mean']:.3f} "
              f"truncated {metrics.get('completion/truncated_frac', 0.0):.2f}", flush=True)
    for name, s in state.items():  # an arm stopped by max_steps before its last mark is evaluated at its end
        if s["next_mark"] < len(marks):
            s["curve"].append((s["seconds"], engines[name].evaluate("t")["eval/t/accuracy"]))
    return state


def summarise(results: dict[int, dict[str, dict]], arms: list[str], budget: float,
              pool: int | None = None) -> tuple[list[list], dict[str, dict]]:
    """Per arm over seeds: time to GRPO's final accuracy as a fraction of GRPO's own time to it (its first mark at
    or above its final accuracy: a GRPO run that peaked and fell back got there before its end), final accuracy
    (and its difference to GRPO's), accuracy at equal time (area under the curve over the budget, its difference to
    GRPO's, and the mean over the marks' difference), generated tokens per useful row relative to GRPO's and passes
    over the pool; each seed paired with its own GRPO run."""
    out: dict[str, dict] = {}
    for name in arms:
        v: dict[str, list] = {k: [] for k in ("times", "finals", "final", "area", "areas", "means", "per_row",
                                              "passes")}
        for state in results.values():
            grpo, arm = state["grpo"], state[name]
            target, grpo_time = _grpo_final(grpo)
            reached = _first_reached(arm["curve"], target)
            v["times"].append(None if reached is None else reached / grpo_time)
            v["final"].append(arm["curve"][-1][1])
            v["finals"].append(arm["curve"][-1][1] - target)
            v["area"].append(area_under(arm["curve"], budget))
            v["areas"].append(v["area"][-1] - area_under(grpo["curve"], budget))
            v["means"].append(_mean_accuracy(arm["curve"]) - _mean_accuracy(grpo["curve"]))
            v["per_row"].append((arm["tokens"] / arm["useful"]) / (grpo["tokens"] / grpo["useful"])
                                if arm["useful"] and grpo["useful"] else float("nan"))
            v["passes"].append(pool_passes(arm, pool))  # `pool` for files saved before arms recorded theirs
        out[name] = v
    rows = [[name, _spread(v["times"]), _spread(v["final"]), _spread(v["finals"], signed=True), _spread(v["area"]),
             _spread(v["areas"], signed=True), _spread(v["means"], signed=True), _spread(v["per_row"]),
             _spread(v["passes"])] for name, v in out.items()]
    return rows, out


HEADERS = ["arm", "time to GRPO's final accuracy / GRPO's time to it", "final accuracy", "final accuracy - GRPO's",
           "area under the curve / budget", "area - GRPO's", "mean accuracy over the marks - GRPO's",
           "generated tokens per useful row / GRPO's", "passes over the pool"]


def area_under(curve: Sequence[Sequence[float]], budget: float) -> float:
    """Accuracy at equal time over the whole budget T: (1/T) x the integral from 0 to T of the accuracy a(t), with
    a(t) linear between marks (the trapezoid rule). Unlike the mean over the marks, which are packed early, it
    weighs each stretch of the budget by its length. A curve whose last mark lies past T (the step that crossed
    it) is cut at T by linear interpolation; one that ends before T (stopped by --max-steps) holds its last value."""
    area = 0.0
    for (t0, a0), (t1, a1) in zip(curve, curve[1:]):
        if t0 >= budget:
            break
        if t1 > budget:
            t1, a1 = budget, a0 + (a1 - a0) * (budget - t0) / (t1 - t0)
        area += (t1 - t0) * (a0 + a1) / 2
    last_t, last_a = curve[-1]
    if last_t < budget:
        area += (budget - last_t) * last_a
    return area / budget


def pool_passes(arm: dict[str, Any], pool: int | None = None) -> float:
    """Questions an arm drew (screened-out ones included) over the pool's size: its passes over the pool. Files
    saved before arms recorded their pool take it from `pool`; before they counted questions: nan."""
    size = arm.get("pool", pool)
    return arm["considered"] / size if "considered" in arm and size else float("nan")


def _mean_accuracy(curve: list[tuple[float, float]]) -> float:
    """Mean held-out accuracy over the marks after the start. One mark moves by about +-0.08 on 40 questions, and
    the time to a target rests on the first mark that crosses it; the mean over all marks is the steadier reading
    of how fast an arm learned within the budget (the marks sit at the same fractions of it for every arm)."""
    return statistics.fmean(a for _, a in curve[1:])


def levelled_off(curve: list[tuple[float, float]], questions: int) -> bool:
    """Whether held-out accuracy had stopped rising by the end of the budget: a least-squares line through the marks
    in the second half of the budget rises across them by no more than one mark's noise, the binomial standard error
    sqrt(p(1 - p) / n) of one mark of n questions at their mean accuracy p. A curve that peaked and fell back has
    levelled off too. Fewer than three marks in the second half cannot tell: False."""
    late = [(t, a) for t, a in curve[1:] if t >= curve[-1][0] / 2]
    if len(late) < 3:
        return False
    seconds, accuracy = [t for t, _ in late], [a for _, a in late]
    rise = statistics.linear_regression(seconds, accuracy).slope * (seconds[-1] - seconds[0])
    p = statistics.fmean(accuracy)
    return rise <= math.sqrt(p * (1 - p) / questions)


def grpo_levelled(results: dict[int, dict[str, dict]], questions: int) -> list[str]:
    """The time target needs a budget in which GRPO levels off: below it, "GRPO's final accuracy" is wherever GRPO
    happened to stop, its time to it is the whole budget, and the time ratio measures the budget, not the arms."""
    flat = [seed for seed, state in results.items() if levelled_off(state["grpo"]["curve"], questions)]
    line = (f"GRPO levelled off (its second half rose by at most one mark's noise) in {len(flat)} of {len(results)} "
            f"seeds: {flat}")
    if len(flat) < len(results):
        line += ("; in the others it was still rising at the end, so this budget is too short to judge the time "
                 "target there")
    return [line]


def mark_resolution(results: dict[int, dict[str, dict]], first_mark: float) -> list[str]:
    """The time ratio is read at the marks: an arm that had reached GRPO's final accuracy by its first mark reads at
    least (first mark) / (GRPO's time to it), however early it got there. Where GRPO got there at its second mark,
    that floor is about 0.5, the target itself, and the ratio cannot tell the arms that reached it first apart."""
    floors: list[float] = []
    early: dict[str, int] = {}  # per arm: seeds in which it was there at its first mark
    for state in results.values():
        target, grpo_time = _grpo_final(state["grpo"])
        floors.append(first_mark / grpo_time)
        for name, arm in state.items():
            if name != "grpo" and len(arm["curve"]) > 1:
                early[name] = early.get(name, 0) + (arm["curve"][1][1] >= target)
    line = (f"The smallest time ratio these marks can show, the first mark ({first_mark:.0f} s) over GRPO's time to "
            f"its final accuracy: {_spread(floors)}")
    if any(early.values()):
        line += ("; already there at their first mark: "
                 + ", ".join(f"{name} in {n} of {len(results)} seeds" for name, n in early.items() if n))
    return [line]


def _grpo_final(grpo: dict[str, Any]) -> tuple[float, float]:
    """GRPO's final held-out accuracy, the target every arm is timed to, and GRPO's own time to it: its first mark at
    or above it (a GRPO run that peaked and fell back got there before its end)."""
    target = grpo["curve"][-1][1]
    seconds = _first_reached(grpo["curve"], target)
    assert seconds is not None  # GRPO's own last mark is at its final accuracy
    return target, seconds


def _first_reached(curve: list[tuple[float, float]], target: float) -> float | None:
    """Seconds of the first mark after the start at or above `target`; None if none is."""
    return next((t for t, a in curve[1:] if a >= target), None)


def _spread(values: Sequence[float | None], signed: bool = False) -> str:
    """Median (min-max) over seeds; a seed that never reached the target counts as infinitely slow."""
    shown = [float("inf") if v is None else v for v in values]
    fmt = "{:+.3f}" if signed else "{:.2f}"
    med = statistics.median(shown)
    text = fmt.format(med) if med != float("inf") else "not reached"
    if len(shown) > 1:
        text += " (" + "-".join("never" if v == float("inf") else fmt.format(v) for v in (min(shown), max(shown))) + ")"
    return text


def verdict(summary: dict[str, dict]) -> list[str]:
    """The best arm (the lowest median time ratio; the higher median final accuracy breaks a tie) against the
    targets, then every arm's medians; a missed target says missed, with its number."""
    med = {name: (statistics.median(_inf(v["times"])), statistics.median(v["finals"]),
                  statistics.median(v["per_row"]), statistics.median(v["areas"]))
           for name, v in summary.items() if name != "grpo"}
    if not med:
        return []
    best = min(med, key=lambda n: (med[n][0], -med[n][1]))
    t, final = med[best][:2]
    lines = [f"Best arm {best}: time to GRPO's final accuracy {_times(t)} at the median "
             f"({_met(t <= TIME_TARGET)}: target <= {TIME_TARGET}x), final accuracy {final:+.3f} vs GRPO at the "
             f"median ({_met(final >= 0)}: target >= 0): "
             + ("targets met" if t <= TIME_TARGET and final >= 0 else "targets MISSED")]
    for name, (t, final, row, area) in med.items():
        lines.append(f"{name}: time {_times(t)} ({_met(t <= TIME_TARGET)}), final accuracy {final:+.3f} vs GRPO "
                     f"({_met(final >= 0)}), area under the curve {area:+.3f} vs GRPO, tokens per useful row "
                     f"{row:.2f}x GRPO's ({_met(row <= ROW_TARGET)}: target <= {ROW_TARGET}x)")
    return lines


def _inf(times: Sequence[float | None]) -> list[float]:
    return [float("inf") if t is None else t for t in times]


def _times(ratio: float) -> str:
    return "not reached" if ratio == float("inf") else f"{ratio:.2f}x GRPO's"


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def per_row_floor(results: dict[int, dict[str, dict]], questions: int, group_size: int = 8) -> list[str]:
    """No arm generates fewer than one completion per useful row, and a CPPO arm, which trains a quarter of what it
    generates, fewer than 1 / (1 - P) = 4; GRPO generates 1 / (its useful share). So in completions an arm's ratio to
    GRPO is at least GRPO's useful share (4x it for CPPO arms), and the ROW_TARGET (0.5x) is out of reach wherever GRPO
    wastes less than half its rows. (Tokens follow completions where the arms' completion lengths match.)"""
    shares = []
    for state in results.values():
        grpo = state["grpo"]  # a static GRPO step generates B x G completions (files saved before "completions")
        generated = grpo.get("completions") or grpo["steps"] * questions * group_size
        shares.append(grpo["useful"] / generated)
    text, cppo_floor = ", ".join(f"{s:.2f}" for s in shares), 1 / (1 - PRUNED)
    return [f"GRPO trained on a row with non-zero advantage in {text} of the completions it generated (by seed): "
            f"the smallest tokens-per-useful-row ratio an arm can reach is about that share, and {cppo_floor:.0f}x "
            f"it for a CPPO arm at P = {PRUNED}, so the {ROW_TARGET}x target needs GRPO to waste more than half its "
            f"rows ({'it did in no seed' if min(shares) >= 0.5 else 'it did in some seeds'})"]


def unseen_history(results: dict[int, dict[str, dict]], pool: int) -> list[str]:
    """A history-based selector (greso, mopps) decides from a question's past rollouts: in an arm that made at most
    one pass over the pool, no question came back, and the selector had nothing to go on."""
    lines = []
    for name in sorted({n for state in results.values() for n in state if n.split("+")[0] in HISTORY}):
        most = max(pool_passes(state[name], pool) for state in results.values() if name in state)
        if most <= 1:
            lines.append(f"{name} made at most {most:.2f} passes over the pool in a seed: no question came back, so "
                         "its selector had no history and cannot be judged here (use a smaller --pool or a longer "
                         "--budget)")
    return lines


def pool_notes(results: dict[int, dict[str, dict]], fresh: bool, pool: int | None = None) -> list[str]:
    """Each arm's most passes over the pool in any seed. In a fresh pool an arm above MAX_PASSES saw questions come
    back, the very thing a fresh pool is there to rule out; its questions per second say what --rate would do."""
    most = {name: max(pool_passes(state[name], pool) for state in results.values())
            for name in next(iter(results.values()))}
    line = "Most passes over the pool in a seed: " + ", ".join(f"{n} {v:.2f}" for n, v in most.items())
    over = [n for n, v in most.items() if v > MAX_PASSES]
    if not fresh:
        return [line + "; a repeating pool: questions came back, and an arm with many passes may have learned "
                "its pool rather than the skill (read it beside a fresh-pool run)"]
    if not over:
        return [line + f"; no arm made more than {MAX_PASSES:.0f}, so none ran short of fresh questions"]
    rate = max(s[n]["considered"] / s[n]["seconds"] for s in results.values() for n in over if s[n]["seconds"])
    return [line + f"; {', '.join(over)} made more than {MAX_PASSES:.0f}: the pool was too small for "
            f"{rate:.2f} questions/s (run again with --rate {math.ceil(rate * 10) / 10:.1f} or more)"]


def settings(args: argparse.Namespace, arms: dict[str, list[str]]) -> dict:
    """What a saved seed's curves depend on besides its seed: seeds saved under other settings must not be mixed.
    Keys added later appear only where they differ from how older files ran, so those files still resume."""
    keys = ("model", "budget", "pool", "questions", "max_new", "lr", "eval_limit", "eval_at", "max_steps", "set")
    saved = {k: getattr(args, k) for k in keys}
    saved["arms"] = list(arms)
    if args.schedule != "constant":  # files saved before --schedule ran at a constant rate and carry no such key
        saved["schedule"] = args.schedule
    if args.pool == "fresh":
        saved["rate"] = args.rate
    custom = {name: overrides for name, overrides in arms.items() if name not in ARMS}
    if custom:
        saved["arm_settings"] = custom
    return saved


def load_saved(path: Path) -> tuple[dict | None, dict[int, dict[str, dict]]]:
    """A --save file: its settings (None for files saved before they were recorded) and its seeds' curves."""
    data = json.loads(path.read_text())
    saved_settings, seeds = (data["settings"], data["seeds"]) if "seeds" in data else (None, data)
    return saved_settings, {int(seed): state for seed, state in seeds.items()}


class OtherSettings(Exception):
    """A --save file holds seeds measured under other settings than this run's."""


def measure(args: argparse.Namespace, arms: dict[str, list[str]], pool: int,
            run: Callable[..., dict[str, dict]] | None = None) -> dict[int, dict[str, dict]]:
    """The seeds asked for, each measured by `run` (run_seed) unless the --save file already holds it under the
    same settings; the file is rewritten after every seed, so a long run can be split over invocations or survive
    a crash. A file saved under other settings is refused (OtherSettings), not mixed in."""
    run = run or run_seed
    measured: dict[int, dict[str, dict]] = {}  # every seed of the --save file, asked for this time or not
    if args.save and args.save.exists():
        saved_settings, measured = load_saved(args.save)
        if saved_settings != settings(args, arms):
            raise OtherSettings(f"{args.save} was saved with other settings ({saved_settings}); run with those, or "
                             "--save to a new file")
        print(f"resuming {args.save}: seeds {sorted(s for s in measured if s in args.seeds)} already measured",
              flush=True)
    for seed in [s for s in args.seeds if s not in measured]:
        measured[seed] = run(args, seed, arms, pool)
        if args.save:  # the file keeps the seeds this run was not asked for
            args.save.write_text(json.dumps({"settings": settings(args, arms), "seeds": measured}, indent=1))
    return {seed: measured[seed] for seed in args.seeds}


def check_arms(args: argparse.Namespace, arms: dict[str, list[str]], pool: int) -> None:
    """Compose every arm's config before any model loads, so a mistyped --arm key fails in a second, not after the
    arms before it have trained (UserError, naming the key)."""
    from gpo.config import compose

    for overrides in arms.values():
        compose(["tracker=none", "model.path=" + args.model, "task=arith", f"task.train_size={pool}", *args.set,
                 *overrides])


def curve_rows(results: dict[int, dict[str, dict]], pool: int | None = None) -> list[list]:
    """One row per seed and arm. Tokens per completion is there because tokens per useful row counts tokens: an arm
    whose completions run to the length cap doubles that ratio without wasting a single row more."""
    def per_completion(s: dict) -> str:
        return f"{s['tokens'] / s['completions']:.1f}" if s.get("completions") else "-"  # older files lack counts
    return [[seed, name, s["steps"], f"{pool_passes(s, pool):.2f}" if "considered" in s else "-",
             per_completion(s), " ".join(f"{t:.0f}s:{a:.3f}" for t, a in s["curve"])]
            for seed, state in results.items() for name, s in state.items()]


def _pool_arg(text: str) -> int | str:
    if text == "fresh":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--pool takes `fresh` or a positive number of questions, got {text!r}")
    return int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--budget", type=float, default=240, help="training seconds per arm (summed step time)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--arms", nargs="+", default=[n for n in ARMS if not uses_history(ARMS[n])], choices=list(ARMS))
    p.add_argument("--arm", action="append", default=[], metavar="NAME=ITEM,ITEM",
                   help="one more arm: each item an arm whose settings it takes, or a key=value override, e.g. "
                   "screen+cppo-p875=screen+cppo,pruner.rate=0.875 (repeatable)")
    p.add_argument("--pool", type=_pool_arg, default="fresh", help="task.train_size: `fresh`, one pass at --rate "
                   "questions/s over the budget, or a fixed number, a repeating pool (greso and mopps need one)")
    p.add_argument("--rate", type=float, default=FRESH_RATE, help="questions per second a fresh pool is sized for")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-5, help="the peak learning rate")
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="cosine: from --lr down to 0 over each arm's own budget (by time)")
    p.add_argument("--eval-limit", type=int, default=50)
    p.add_argument("--eval-at", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0],
                   help="fractions of the budget; early ones resolve time ratios below 0.5, and the levelled-off check "
                   "needs three or more in the second half")
    p.add_argument("--max-steps", type=int, default=10_000)
    p.add_argument("--save", type=Path, help="write every finished seed's curves here as JSON, so a long run that "
                   "dies later keeps what it measured; run again with the same file and settings, and the seeds it "
                   "holds are not measured again (a long run split over several invocations)")
    p.add_argument("--from-json", type=Path, help="tabulate a run saved with --save instead of running one")
    add_common(p)
    args = p.parse_args()
    saved_settings, results = load_saved(args.from_json) if args.from_json else (None, {})
    for key in ("budget", "pool", "rate", "questions", "eval_limit", "eval_at", "schedule"):  # describe that run
        if saved_settings and key in saved_settings:
            setattr(args, key, saved_settings[key])
    try:
        arms = arm_overrides(args.arms, args.arm)
    except ValueError as exc:
        p.error(str(exc))
    if results:  # the arms the file holds, whatever --arms says
        arms = {name: (saved_settings or {}).get("arm_settings", {}).get(name, ARMS.get(name, []))
                for name in next(iter(results.values()))}
    if "grpo" not in arms:
        p.error("--arms must include grpo: every arm is measured against it")
    history = [name for name, overrides in arms.items() if uses_history(overrides)]
    if args.pool == "fresh" and history and not results:
        p.error(f"{', '.join(history)} learn from questions that come back: run them apart with a repeating pool "
                "(--pool 64)")
    pool = pool_size(args.pool, args.budget, args.rate)
    if not results:
        from gpo.errors import UserError

        try:
            check_arms(args, arms, pool)
            results = measure(args, arms, pool)
        except (UserError, OtherSettings) as exc:
            p.error(str(exc))
    rows, summary = summarise(results, list(arms), args.budget, pool)
    body = table(HEADERS, rows)
    body += "\n\n" + table(["seed", "arm", "steps", "passes over the pool", "generated tokens per completion",
                            "held-out accuracy (time:acc)"], curve_rows(results, pool))
    notes = (verdict(summary) + grpo_levelled(results, args.eval_limit)
             + mark_resolution(results, args.budget * min(args.eval_at)) + per_row_floor(results, args.questions)
             + pool_notes(results, args.pool == "fresh", pool) + unseen_history(results, pool))
    body += "\n\n" + "\n".join(f"- {v}" for v in notes)
    print(body)
    schedule = "constant" if args.schedule == "constant" else "peak, cosine to 0 over each arm's budget"
    source = (f"a fresh pool of {pool} train questions (one pass at {args.rate} questions/s)" if args.pool == "fresh"
              else f"a repeating pool of {pool} train questions")
    custom = "".join(f"; arm {name}: {' '.join(o)}" for name, o in arms.items() if name not in ARMS)
    note = (f"\n\nSizes: {args.model}, two-digit arith from {source}, B={args.questions}, G=8, at most "
            f"{args.max_new} new tokens, lr {args.lr} {schedule}, budget {args.budget:.0f} s of training per arm, "
            f"seeds {sorted(results)}; held-out accuracy is greedy on the first {args.eval_limit} validation "
            f"questions at {args.eval_at} of the budget (an arm is seen to reach the target only at those marks)"
            f"{custom}.")
    write_section("time_to_accuracy", "Time to accuracy: selection before generation composed with CPPO",
                  body + note, args, variant=f"pool {args.pool}, budget {args.budget:.0f} s"
                  + ("" if args.schedule == "constant" else f", lr {args.schedule}")
                  # GRPO alone is a probe of how long a budget it needs to level off: not the comparison at it
                  + (", grpo only" if list(arms) == ["grpo"] else "")
                  # arms of the command line's own (--arm) make another comparison, kept beside the built-in one
                  + "".join(f", arm {name}" for name in arms if name not in ARMS))


if __name__ == "__main__":
    main()
