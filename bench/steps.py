"""Whole training steps, GRPO vs CPPO, against the bound Amdahl's law puts on CPPO's speedup.

Pruning speeds up only the post-generation phases, so with s the share of a GRPO step spent generating and
rewarding, a step that trains a fraction (1-P) of the rows can be at most 1 / (s + (1-s)(1-P)) times faster.
Three arms, stepped in turn (A, B, C, A, B, C, ...) by one engine that swaps in each arm's pruner and allocator:
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

from harness import add_common, engine, freeze_weights, replayed_steps, spread, table, write_section


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

    # One engine serves every arm, so all arms generate with the very same weights in memory. Learning rate 0
    # (harness.freeze_weights): every step still does all its work (gradients, an AdamW update) but the weights stay
    # put, and before each arm's step the question stream and step counter are rewound, so every arm draws the same
    # questions with the same seeds and grpo and cppo-static generate identical tokens (trained arms drift apart
    # after one step).
    common = [f"model.path={args.model}", "task=arith", "algo=grpo", f"train.questions_per_step={args.questions}",
              f"train.group_size={args.group}", f"train.max_completion_length={args.max_new}", "train.steps=1000",
              "pruner=none", "allocator=static", *args.set]
    eng = engine(*common)
    freeze_weights(eng)
    topk = {"rate": args.rate}
    arms = {
        "grpo": (_part("pruner", "none", {}), _part("allocator", "static", {})),
        "cppo-static": (_part("pruner", "topk", topk), _part("allocator", "static", {})),
        "cppo-dynamic": (_part("pruner", "topk", topk), _part("allocator", "dynamic", {})),
    }

    def setup(name: str) -> None:  # the rollout prunes and allocates (the engine only holds what it was built with)
        eng.rollout.pruner, eng.rollout.allocator = arms[name]

    # The arms' order rotates from repeat to repeat: a step's speed depends on which step ran before it in the
    # process. With a fixed order, cppo-static (always right after grpo) generated 8-12% slower than grpo in three
    # runs, twice on identical tokens, which pruning cannot cause; rotating gives every arm every position alike.
    runs = replayed_steps(eng, list(arms), args.repeats, setup)

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
                     spread(gen(name)), spread(col(name, "time/logprobs")), spread(col(name, "time/update")),
                     spread(step),
                     spread([s / q for s, q in zip(step, questions)]),
                     spread([s / max(t, 1) for s, t in zip(step, trained)])])
    headers = ["arm", "questions", "rows trained", "tokens generated", "generate+reward s", "logprobs s", "update s",
               "step s", "s / question", "s / trained row"]

    # Paired within a repeat: the GRPO step and the CPPO step of the same questions.
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
    note = (f"\n\nSizes: {args.model}, {eng.cfg.task.name}, B={args.questions}, G={args.group}, "
            f"at most {args.max_new} new tokens, "
            f"P={args.rate}, beta 0.04 (reference pass on), mu 1, learning rate 0 (see below). One engine, one warm-up "
            f"step per arm, then {args.repeats} repeats, each running the arms on the same questions, in an order "
            "that rotates from repeat to repeat; cells are median (min-max). Generation share s (generate + reward, of "
            f"the GRPO step) = {spread(share)}; bound = 1 / (s + (1-s)(1-P)) per repeat. "
            "One engine serves all arms (each swaps in its pruner and allocator) with lr 0 (harness.freeze_weights): "
            "every step does all its work (gradients and an AdamW "
            "step) but the weights stay put, and each arm's step replays the same questions and seeds, so grpo "
            "and cppo-static generate identical completions (equal `tokens generated`) with the same weights in "
            "memory, and Amdahl's premise, an unchanged generation phase, holds. "
            "`s / trained row` shows the price of the dynamic allocator: it generates 1/(1-P) times the completions "
            "to fill GRPO's rows, so per trained row it is slower, by design. It buys more questions seen per step.")
    write_section("steps", "Step speedup vs Amdahl's bound: GRPO vs CPPO", body + note, args)


def _part(kind: str, name: str, cfg: dict):
    from gpo import registry

    return registry.get(kind, name).build(cfg)


if __name__ == "__main__":
    main()
