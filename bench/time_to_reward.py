"""Time to reward: GRPO vs CPPO (top-k, dynamic allocator) on arith with the same wall-clock training budget.

All arms of one seed live in one process and take training steps in turn (the arm with the least training time so
far goes next), so load from other jobs hits them alike; each arm stops when its own summed step time reaches the
budget. Held-out greedy accuracy (validation split) is measured at fixed fractions of the budget, outside the
budgeted time. The target is that CPPO reaches GRPO's final held-out accuracy in at most half the time.

    python bench/time_to_reward.py --budget 240 --seeds 1 2
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from harness import add_common, engine, table, write_section

ARMS = {
    "grpo": ["pruner=none", "allocator=static"],
    "cppo P=0.75": ["pruner=topk", "pruner.rate=0.75", "allocator=dynamic"],
    "cppo P=0.875": ["pruner=topk", "pruner.rate=0.875", "allocator=dynamic"],
}


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, dict]:
    common = [f"model.path={args.model}", "task=arith", "algo=grpo", f"seed={seed}", f"train.steps={args.max_steps}",
              f"train.questions_per_step={args.questions}", f"train.max_completion_length={args.max_new}",
              f"optim.lr={args.lr}", "optim.schedule=constant", "optim.warmup_ratio=0", f"eval.limit={args.eval_limit}",
              f"eval.max_new_tokens={args.max_new}", *args.set]
    arms = {name: engine(*common, *extra) for name, extra in ARMS.items()}
    marks = [args.budget * f for f in args.eval_at]
    first = next(iter(arms.values()))
    start_acc = first.evaluate("t")["eval/t/accuracy"]  # every arm starts from the same weights
    state: dict[str, dict[str, Any]] = {  # per arm: its clock, counts and curves, of mixed types
        name: {"seconds": 0.0, "steps": 0, "questions": 0, "rewards": [], "curve": [(0.0, start_acc)],
               "next_mark": 0} for name in arms}
    while True:
        active = [n for n in arms if state[n]["seconds"] < args.budget and state[n]["steps"] < args.max_steps]
        if not active:
            break
        name = min(active, key=lambda n: state[n]["seconds"])
        s, eng = state[name], arms[name]
        metrics = eng.step()
        s["seconds"] += metrics["time/step"]
        s["steps"] += 1
        s["questions"] += int(metrics.get("alloc/questions", args.questions))
        s["rewards"].append((s["seconds"], metrics["reward/mean"]))
        while s["next_mark"] < len(marks) and s["seconds"] >= marks[s["next_mark"]]:
            s["curve"].append((s["seconds"], eng.evaluate("t")["eval/t/accuracy"]))
            s["next_mark"] += 1
        print(f"seed {seed} {name}: {s['seconds']:.0f}s step {s['steps']} reward {metrics['reward/mean']:.3f}",
              flush=True)
    for name, s in state.items():  # an arm stopped by max_steps before its last mark is evaluated at its end
        if s["next_mark"] < len(marks):
            s["curve"].append((s["seconds"], arms[name].evaluate("t")["eval/t/accuracy"]))
    return state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--budget", type=float, default=240, help="training seconds per arm (summed step time)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--eval-limit", type=int, default=32)
    p.add_argument("--eval-at", type=float, nargs="+", default=[0.5, 1.0], help="fractions of the budget")
    p.add_argument("--max-steps", type=int, default=10_000)
    add_common(p)
    args = p.parse_args()

    results = {seed: run_seed(args, seed) for seed in args.seeds}
    rows = []
    for seed, state in results.items():
        for name, s in state.items():
            tail = [r for _, r in s["rewards"][len(s["rewards"]) // 2 :]]  # second half of the budget
            curve = " ".join(f"{t:.0f}s:{a:.3f}" for t, a in s["curve"])
            rows.append([seed, name, s["steps"], s["questions"], f"{statistics.mean(tail):.3f}", curve])
    body = table(["seed", "arm", "steps", "questions seen", "train reward, 2nd half", "held-out accuracy (time:acc)"],
                 rows)
    verdicts = []
    for seed, state in results.items():
        target = state["grpo"]["curve"][-1][1]
        for name in list(ARMS)[1:]:
            reached = next((t for t, a in state[name]["curve"][1:] if a >= target), None)
            verdicts.append(f"seed {seed}, {name}: GRPO's final accuracy {target:.3f} "
                            + ("not reached" if reached is None else f"reached by {reached:.0f}s "
                               f"({reached / state['grpo']['seconds']:.2f} of GRPO's time)"))
    body += "\n\n" + "\n".join(f"- {v}" for v in verdicts)
    print(body)
    note = (f"\n\nSizes: {args.model}, arith, B={args.questions} (CPPO draws B/(1-P) questions per step), G=8, at most "
            f"{args.max_new} new tokens, lr {args.lr} constant, beta 0.04, budget {args.budget:.0f} s of training "
            f"per arm, seeds {args.seeds}; held-out accuracy is greedy on the first {args.eval_limit} validation "
            f"questions, at {args.eval_at} of the budget (resolution: a CPPO arm can only be seen to reach the "
            "target at those marks). With this few steps and questions, accuracy differences of one or two "
            f"questions out of {args.eval_limit} are noise; read this table as a smoke test of the setup, not "
            "evidence for or against the paper's claim.")
    write_section("time_to_reward", "Time to reward: GRPO vs CPPO at equal wall-clock budget", body + note, args)


if __name__ == "__main__":
    main()
