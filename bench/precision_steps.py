"""Whole default steps for each combination of rollout precision (backend.precision) and update precision
(engine.mixed_precision), side by side, with each step's phases and the generator/trainer mismatch it logged.

One engine serves every arm, so all arms start from the very same weights: each arm swaps in an hf backend of its
rollout precision (the low-precision copy is made in the untimed warm-up round and refreshed after every step, the
refresh timed as `time/weight_sync`) and sets the log-prob modules' autocast, which is what
engine.mixed_precision=bf16 sets on a run without DeepSpeed. Learning rate 0 keeps the weights put, and before each
arm's step the question stream and step counter are rewound, so every arm draws the same questions with the same
seeds. The arms' order rotates from repeat to repeat. Precisions this machine cannot run are left out
(gpo/backends/precision.py says which).

    python bench/precision_steps.py --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import statistics

from harness import add_common, engine, freeze_weights, replayed_steps, spread, table, write_section
from precision import set_precision

ROLLOUT = ["float32", "bf16", "int8"]
UPDATE = ["no", "bf16"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rollout", nargs="+", choices=ROLLOUT, default=ROLLOUT)
    p.add_argument("--update", nargs="+", choices=UPDATE, default=UPDATE)
    p.add_argument("--repeats", type=int, default=3)
    add_common(p)
    args = p.parse_args()

    from gpo.backends.hf import HFBackend, HFConfig
    from gpo.backends.precision import runnable
    from gpo.hardware import this_machine

    eng = engine(f"model.path={args.model}", "train.steps=1000", *args.set)
    freeze_weights(eng)
    here = runnable("hf", this_machine())
    backends = {r: HFBackend(HFConfig(precision=r), eng.policy, eng.tokenizer) for r in args.rollout
                if r == "float32" or r in here}
    arms = [(r, u) for r, u in itertools.product(backends, args.update) if u == "no" or "bf16" in here]

    def setup(arm: tuple[str, str]) -> None:
        eng.rollout.backend = backends[arm[0]]
        set_precision(eng, arm[1])

    runs = replayed_steps(eng, arms, args.repeats, setup)  # the warm-up round makes each copy, untimed

    def col(arm: tuple[str, str], key: str) -> list[float]:
        return [m.get(key, 0.0) for m in runs[arm]]

    base = ("float32", "no")
    rows = []
    for arm in arms:
        step = col(arm, "time/step")
        paired = [b / s for b, s in zip(col(base, "time/step"), step)]
        rows.append([arm[0], arm[1], spread(col(arm, "tokens/generated")), spread(col(arm, "time/generate")),
                     spread(col(arm, "time/weight_sync")), spread(col(arm, "time/logprobs")),
                     spread(col(arm, "time/update")), spread(step),
                     spread(paired) if arm != base else "-",
                     f"{statistics.median(col(arm, 'mismatch/logp_abs_mean')):.4f} / "
                     f"{statistics.median(col(arm, 'mismatch/logp_abs_max')):.3f}",
                     f"{statistics.median(col(arm, 'mismatch/kl_gen_train')):.5f}"])
    body = table(["backend.precision", "engine.mixed_precision", "tokens generated", "generate s", "weight sync s",
                  "logprobs s", "update s", "step s", "speedup vs float32/no", "mismatch: abs log-prob gap mean / max",
                  "KL(gen, train)"], rows)
    print(body)
    cfg = eng.cfg
    note = (f"\n\nThe default step ({args.model}, {cfg.task.name}, algo={cfg.algo.name}, pruner={cfg.pruner.name}, "
            f"allocator={cfg.allocator.name}, B={eng.train_cfg.questions_per_step}, G={eng.train_cfg.group_size}, at "
            f"most {eng.train_cfg.max_completion_length} new tokens) with learning rate 0; one engine, one warm-up "
            f"round, then {args.repeats} repeats in an order that rotates; median (min-max), speedups paired "
            "within a repeat. Mismatch: |log pi_old - log pi_generator| over the trained tokens (mean / max) and the "
            "k3 estimate of KL(pi_generator || pi_old), where pi_old is the trainer's log-prob in its update "
            "precision. Tokens generated differ between rollout precisions: each samples from its own rounding of "
            "the policy.")
    variant = " ".join(([f"rollout {' '.join(args.rollout)}"] if args.rollout != ROLLOUT else [])
                       + ([f"update {' '.join(args.update)}"] if args.update != UPDATE else []))
    write_section("precision_steps", "Precision: default step by rollout and update precision", body + note, args,
                  variant)


if __name__ == "__main__":
    main()
