"""Whole training steps, GRPO vs CPPO, against the bound Amdahl's law puts on CPPO's speedup.

Pruning speeds up only the post-generation phases, so with s the share of a GRPO step spent generating and
rewarding, a step that trains a fraction (1-P) of the rows can be at most 1 / (s + (1-s)(1-P)) times faster.
Three arms, built side by side in one process and stepped in turn (A, B, C, A, B, C, ...):
  grpo          pruner=none, allocator=static: B questions, all B*G completions trained
  cppo-static   pruner=topk P, allocator=static: the same B questions and completions, (1-P)*B*G trained.
                The like-for-like comparison: equal questions, equal generation, so Amdahl's bound applies.
  cppo-dynamic  pruner=topk P, allocator=dynamic (the paper's setting): draws B/(1-P) questions, generates G for
                each, trains the same B*G rows as GRPO. Per step it does more work (it generates 1/(1-P) times as
                much); per question drawn it is the same trade as cppo-static. Both are reported.

    python bench/steps.py --questions 4 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics

from harness import add_common, engine, spread, table, write_section


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--rate", type=float, default=0.75)
    p.add_argument("--repeats", type=int, default=3)
    add_common(p)
    args = p.parse_args()

    # optim.lr=0: every step still computes everything (gradients, AdamW update of zero size), but no arm's weights
    # move, so with equal seeds the grpo and cppo-static arms generate the very same completions at every step.
    # Trained arms drift apart after one step, and a few longer completions in one arm would then pass for a
    # pruning overhead (an earlier run: cppo-static generated 8% longer, a third of its gap to the bound).
    common = [f"model.path={args.model}", "task=arith", "algo=grpo", f"train.questions_per_step={args.questions}",
              f"train.group_size={args.group}", f"train.max_completion_length={args.max_new}", "train.steps=1000",
              "optim.lr=0", *args.set]
    arms = {
        "grpo": engine(*common, "pruner=none", "allocator=static"),
        "cppo-static": engine(*common, "pruner=topk", f"pruner.rate={args.rate}", "allocator=static"),
        "cppo-dynamic": engine(*common, "pruner=topk", f"pruner.rate={args.rate}", "allocator=dynamic"),
    }
    for eng in arms.values():  # warm-up step, not counted
        eng.step()
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, eng in arms.items():
            runs[name].append(eng.step())

    def col(name: str, key: str) -> list[float]:
        return [m.get(key, 0.0) for m in runs[name]]

    def gen(name: str) -> list[float]:
        return [a + b for a, b in zip(col(name, "time/generate"), col(name, "time/reward"))]

    rows = []
    for name in arms:
        step = col(name, "time/step")
        questions = col(name, "alloc/questions")
        trained = col(name, "train/rows")
        rows.append([name, f"{statistics.median(questions):.0f}", f"{statistics.median(trained):.0f}",
                     spread(col(name, "tokens/generated")),
                     spread(gen(name)), spread(col(name, "time/logprobs")), spread(col(name, "time/update")), spread(step),
                     spread([s / q for s, q in zip(step, questions)]),
                     spread([s / max(t, 1) for s, t in zip(step, trained)])])
    headers = ["arm", "questions", "rows trained", "tokens generated", "generate+reward s", "logprobs s", "update s", "step s",
               "s / question", "s / trained row"]

    # Paired within a repeat: the GRPO step and the CPPO step that ran right after it.
    share = [g / s for g, s in zip(gen("grpo"), col("grpo", "time/step"))]
    bound = [1 / (s + (1 - s) * (1 - args.rate)) for s in share]
    static = [a / b for a, b in zip(col("grpo", "time/step"), col("cppo-static", "time/step"))]
    per_q = [(a / args.questions) / (b / q) for a, b, q in
             zip(col("grpo", "time/step"), col("cppo-dynamic", "time/step"), col("cppo-dynamic", "alloc/questions"))]
    per_row = [(a / max(ta, 1)) / (b / max(tb, 1)) for a, b, ta, tb in
               zip(col("grpo", "time/step"), col("cppo-dynamic", "time/step"), col("grpo", "train/rows"),
                   col("cppo-dynamic", "train/rows"))]
    summary = table(["comparison", "measured speedup", "Amdahl bound", "% of bound"], [
        ["cppo-static vs grpo, per step (equal questions)", spread(static), spread(bound),
         f"{100 * statistics.median(static) / statistics.median(bound):.0f}%"],
        ["cppo-dynamic vs grpo, per question drawn", spread(per_q), spread(bound),
         f"{100 * statistics.median(per_q) / statistics.median(bound):.0f}%"],
        ["cppo-dynamic vs grpo, per trained row", spread(per_row), "-", "-"],
    ])
    body = table(headers, rows) + "\n\n" + summary
    print(body)
    note = (f"\n\nSizes: {args.model}, arith, B={args.questions}, G={args.group}, at most {args.max_new} new tokens, "
            f"P={args.rate}, beta 0.04 (reference pass on), mu 1, optim.lr=0 (see below). Each arm ran one warm-up step, then {args.repeats} "
            "steps interleaved across arms; cells are median (min-max). Generation share s (generate + reward, of "
            f"the GRPO step) = {spread(share)}; bound = 1 / (s + (1-s)(1-P)) per repeat. With optim.lr=0 every "
            "step does all its work (gradients and an AdamW step) but the weights stay put, so grpo and "
            "cppo-static generate identical completions (equal `tokens generated`) and Amdahl's premise, an "
            "unchanged generation phase, holds exactly. `s / trained row` shows the price of the dynamic allocator: it generates 1/(1-P) times the completions "
            "to fill GRPO's rows, so per trained row it is slower, by design. It buys more questions seen per step.")
    write_section("steps", "Step speedup vs Amdahl's bound: GRPO vs CPPO", body + note, enabled=not args.no_write)


if __name__ == "__main__":
    main()
