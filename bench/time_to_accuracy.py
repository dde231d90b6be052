"""Time to accuracy: does choosing questions before generation (selector) compose with CPPO's pruning after it?

Arms: grpo, dapo (dynamic sampling), cppo (top-k P=0.75 + dynamic allocator), screen (SPEED-RL), screen+cppo,
greso+cppo, mopps+cppo and screen+dapo, on two-digit arith from a fixed pool (task.train_size), so questions come
back and the history-based selectors see them again. All arms of one seed live in one process and take training
steps in turn (the arm with the least training time so far goes next), so load from other jobs hits them alike; each
arm stops when its own summed step time reaches the budget. Held-out greedy accuracy (validation split) is measured
at fixed fractions of the budget, outside the budgeted time, packed early, where most arms learn the answer format.

The learning rate follows a cosine over each arm's own budget by default (--schedule): at a constant rate GRPO here
peaks and falls back (lr 2e-5, 480 s: 0.74 at 196 s, 0.46 at the end), so "GRPO's final accuracy" was the low point
after its fall. Annealed by time, every arm ends at a settled point of the same schedule, and an arm that takes
faster steps gets more of them, not a different schedule.

Reported per arm: time to GRPO's final held-out accuracy (median over seeds, min-max), final accuracy, and
generated tokens per useful trained row (a kept row with non-zero advantage; screened-out rollouts count as
generated). Targets: the best composed arm reaches GRPO's final accuracy in at most 0.5x GRPO's time at
the median over seeds, ends no lower, and generates at most 0.5x GRPO's tokens per useful row. A missed target is
printed as missed, with its numbers.

    python bench/time_to_accuracy.py --budget 480 --lr 2e-5 --seeds 1 2 3 --save run.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
from collections.abc import Sequence
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
COMPOSED = ("screen+cppo", "greso+cppo", "mopps+cppo", "screen+dapo")


def lr_at(seconds: float, budget: float, peak: float, schedule: str) -> float:
    """The learning rate of a step that starts `seconds` into an arm's budget: constant, or a cosine from `peak`
    down to 0 at the end of the budget (by time, not by step: the arms take different numbers of steps)."""
    if schedule == "constant":
        return peak
    return peak * 0.5 * (1 + math.cos(math.pi * min(seconds / budget, 1.0)))


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, dict]:
    common = [f"model.path={args.model}", "task=arith", "task.digits=2", f"task.train_size={args.pool}",
              "algo=grpo", f"seed={seed}", f"train.steps={args.max_steps}",
              f"train.questions_per_step={args.questions}",
              f"train.max_completion_length={args.max_new}", f"optim.lr={args.lr}", "optim.schedule=constant",
              "optim.warmup_ratio=0", f"eval.limit={args.eval_limit}", f"eval.max_new_tokens={args.max_new}", *args.set]
    arms = {name: engine(*common, *ARMS[name]) for name in args.arms}
    marks = sorted(args.budget * f for f in args.eval_at)
    start_acc = next(iter(arms.values())).evaluate("t")["eval/t/accuracy"]  # every arm starts from these weights
    state: dict[str, dict[str, Any]] = {  # JSON-shaped, as --save writes it
        name: {"seconds": 0.0, "steps": 0, "tokens": 0.0, "useful": 0.0, "considered": 0.0, "completions": 0.0,
               "curve": [(0.0, start_acc)], "next_mark": 0} for name in arms}
    while True:
        active = [n for n in arms if state[n]["seconds"] < args.budget and state[n]["steps"] < args.max_steps]
        if not active:
            break
        name = min(active, key=lambda n: state[n]["seconds"])
        s, eng = state[name], arms[name]
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
            s["curve"].append((s["seconds"], arms[name].evaluate("t")["eval/t/accuracy"]))
    return state


def summarise(results: dict[int, dict[str, dict]], arms: list[str]) -> tuple[list[list], dict[str, dict]]:
    """Per arm over seeds: time to GRPO's final accuracy as a fraction of GRPO's own time to it (its first mark at
    or above its final accuracy: a GRPO run that peaked and fell back got there before its end), final accuracy,
    and generated tokens per useful row relative to GRPO's (each seed paired with its own GRPO run)."""
    out: dict[str, dict] = {}
    for name in arms:
        times, finals, per_row, means = [], [], [], []
        for state in results.values():
            grpo, arm = state["grpo"], state[name]
            target, grpo_time = _grpo_final(grpo)
            reached = _first_reached(arm["curve"], target)
            times.append(None if reached is None else reached / grpo_time)
            finals.append(arm["curve"][-1][1] - target)
            means.append(_mean_accuracy(arm["curve"]) - _mean_accuracy(grpo["curve"]))
            ratio = (arm["tokens"] / arm["useful"]) / (grpo["tokens"] / grpo["useful"]) \
                if arm["useful"] and grpo["useful"] else float("nan")
            per_row.append(ratio)
        out[name] = {"times": times, "finals": finals, "per_row": per_row, "means": means}
    rows = [[name, _spread(v["times"]), _spread(v["finals"], signed=True), _spread(v["per_row"]),
             _spread(v["means"], signed=True)] for name, v in out.items()]
    return rows, out


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
    lines = []
    for name in [n for n in COMPOSED if n in summary]:
        v = summary[name]
        times = [float("inf") if t is None else t for t in v["times"]]
        med_t, med_final, med_row = (statistics.median(times), statistics.median(v["finals"]),
                                     statistics.median(v["per_row"]))
        met = med_t <= 0.5 and med_final >= 0 and med_row <= 0.5
        time = "not reached" if med_t == float("inf") else f"{med_t:.2f}x GRPO's"
        lines.append(f"{name}: time {time} (target <= 0.5), final accuracy {med_final:+.3f} vs GRPO "
                     f"(target >= 0), tokens per useful row {med_row:.2f}x (target <= 0.5): "
                     + ("target met" if met else "target MISSED"))
    return lines


def per_row_floor(results: dict[int, dict[str, dict]], questions: int, group_size: int = 8) -> list[str]:
    """No arm generates fewer than one completion per useful row, and a CPPO arm, which trains a quarter of what it
    generates, fewer than 1 / (1 - P) = 4; GRPO generates 1 / (its useful share). So in completions an arm's ratio to
    GRPO is at least GRPO's useful share (4x it for CPPO arms), and the 0.5x target is out of reach wherever GRPO
    wastes less than half its rows. (Tokens follow completions where the arms' completion lengths match.)"""
    shares = []
    for state in results.values():
        grpo = state["grpo"]  # a static GRPO step generates B x G completions (files saved before "completions")
        generated = grpo.get("completions") or grpo["steps"] * questions * group_size
        shares.append(grpo["useful"] / generated)
    text, cppo_floor = ", ".join(f"{s:.2f}" for s in shares), 1 / (1 - PRUNED)
    return [f"GRPO trained on a row with non-zero advantage in {text} of the completions it generated (by seed): "
            f"the smallest tokens-per-useful-row ratio an arm can reach is about that share, and {cppo_floor:.0f}x "
            f"it for a CPPO arm at P = {PRUNED}, so the 0.5x target needs GRPO to waste more than half its rows "
            f"({'it did in no seed' if min(shares) >= 0.5 else 'it did in some seeds'})"]


def unseen_history(results: dict[int, dict[str, dict]], pool: int) -> list[str]:
    """A history-based selector (greso, mopps) decides from a question's past rollouts: in an arm that drew no more
    questions than the pool holds, no question came back, and the selector had nothing to go on."""
    lines = []
    for name in sorted({n for state in results.values() for n in state if n.split("+")[0] in ("greso", "mopps")}):
        drawn = [state[name]["considered"] for state in results.values() if "considered" in state.get(name, {})]
        if drawn and max(drawn) <= pool:
            lines.append(f"{name} drew at most {max(drawn):.0f} questions per seed from a pool of {pool}: no question "
                         "came back, so its selector had no history and cannot be judged here (use a smaller --pool "
                         "or a longer --budget)")
    return lines


def settings(args: argparse.Namespace) -> dict:
    """What a saved seed's curves depend on besides its seed: seeds saved under other settings must not be mixed."""
    keys = ("model", "budget", "arms", "pool", "questions", "max_new", "lr", "eval_limit", "eval_at", "max_steps",
            "set")
    saved = {k: getattr(args, k) for k in keys}
    if args.schedule != "constant":  # files saved before --schedule ran at a constant rate and carry no such key
        saved["schedule"] = args.schedule
    return saved


def load_saved(path: Path) -> tuple[dict | None, dict[int, dict[str, dict]]]:
    """A --save file: its settings (None for files saved before they were recorded) and its seeds' curves."""
    data = json.loads(path.read_text())
    saved_settings, seeds = (data["settings"], data["seeds"]) if "seeds" in data else (None, data)
    return saved_settings, {int(seed): state for seed, state in seeds.items()}


def curve_rows(results: dict[int, dict[str, dict]], pool: int) -> list[list]:
    """One row per seed and arm. Tokens per completion is there because tokens per useful row counts tokens: an arm
    whose completions run to the length cap doubles that ratio without wasting a single row more."""
    def per_completion(s: dict) -> str:
        return f"{s['tokens'] / s['completions']:.1f}" if s.get("completions") else "-"  # older files lack counts
    return [[seed, name, s["steps"], f"{s['considered'] / pool:.2f}" if "considered" in s else "-",
             per_completion(s), " ".join(f"{t:.0f}s:{a:.3f}" for t, a in s["curve"])]
            for seed, state in results.items() for name, s in state.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--budget", type=float, default=240, help="training seconds per arm (summed step time)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--pool", type=int, default=64, help="task.train_size: the fixed pool of training questions; "
                   "small enough that questions come back within the budget, or greso and mopps have no history")
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
    if "grpo" not in args.arms:
        p.error("--arms must include grpo: every arm is measured against it")

    results: dict[int, dict[str, dict]] = {}
    if args.from_json:  # the same arguments as the run that saved it, so the notes below describe that run
        results = load_saved(args.from_json)[1]
    else:
        measured: dict[int, dict[str, dict]] = {}  # every seed of the --save file, asked for this time or not
        if args.save and args.save.exists():  # a run split over invocations: saved seeds are not re-run
            saved_settings, measured = load_saved(args.save)
            if saved_settings != settings(args):
                p.error(f"{args.save} was saved with other settings ({saved_settings}); run with those, or --save "
                        "to a new file")
            print(f"resuming {args.save}: seeds {sorted(s for s in measured if s in args.seeds)} already measured",
                  flush=True)
        for seed in [s for s in args.seeds if s not in measured]:
            measured[seed] = run_seed(args, seed)
            if args.save:  # the file keeps the seeds this run was not asked for
                args.save.write_text(json.dumps({"settings": settings(args), "seeds": measured}, indent=1))
        results = {seed: measured[seed] for seed in args.seeds}
    rows, summary = summarise(results, args.arms)
    body = table(["arm", "time to GRPO's final accuracy / GRPO's time to it", "final accuracy - GRPO's",
                  "generated tokens per useful row / GRPO's", "mean accuracy over the marks - GRPO's"], rows)
    body += "\n\n" + table(["seed", "arm", "steps", "passes over the pool", "generated tokens per completion",
                            "held-out accuracy (time:acc)"], curve_rows(results, args.pool))
    notes = (verdict(summary) + grpo_levelled(results, args.eval_limit)
             + mark_resolution(results, args.budget * min(args.eval_at)) + per_row_floor(results, args.questions)
             + unseen_history(results, args.pool))
    body += "\n\n" + "\n".join(f"- {v}" for v in notes)
    print(body)
    schedule = "constant" if args.schedule == "constant" else "peak, cosine to 0 over each arm's budget"
    note = (f"\n\nSizes: {args.model}, two-digit arith from a pool of {args.pool} train questions, B={args.questions}, "
            f"G=8, at most {args.max_new} new tokens, lr {args.lr} {schedule}, budget {args.budget:.0f} s of training "
            f"per arm, seeds {args.seeds}; held-out accuracy is greedy on the first {args.eval_limit} validation "
            f"questions at {args.eval_at} of the budget (an arm is seen to reach the target only at those marks).")
    write_section("time_to_accuracy", "Time to accuracy: selection before generation composed with CPPO",
                  body + note, args, variant=f"pool {args.pool}, budget {args.budget:.0f} s"
                  + ("" if args.schedule == "constant" else f", lr {args.schedule}")
                  # GRPO alone is a probe of how long a budget it needs to level off: not the comparison at it
                  + (", grpo only" if args.arms == ["grpo"] else ""))


if __name__ == "__main__":
    main()
