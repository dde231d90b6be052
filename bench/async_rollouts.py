"""Whole-step throughput, lockstep against a generator running ahead (train.max_staleness), and what it predicts.

Arms, each in a fresh process, run in turn (A, B, A, B, ...) so that load from other jobs hits both alike:
  lockstep   train.max_staleness=0: generation and training take turns, each with every core
  async-k    train.max_staleness=k: a generator process (half the cores) samples up to k steps ahead while the
             trainer (the other half) updates
Each child runs --warmup steps, then --steps timed ones; its throughput is timed steps / their wall time.

The model (docs/async.md): from the lockstep arm's measured phases, g = generate + reward and t = log-probs +
update + weight sync, lockstep costs g + t per step. A generator with devices of its own (the split of verl's
one-step-off-policy and AReaL, where generator and trainer hold separate GPUs of equal number to lockstep's) costs
max(g, t): gain (g + t) / max(g, t), at most 2. Sharing one pool instead (this CPU: two cores split in two) the
gain is (g + t) / max(g / e_g, t / e_t), with e the fraction of its lockstep speed each phase keeps on half the
pool; with linear scaling (e = 1/2) that is at most 1: async helps on shared devices only where a phase scales
worse than linearly (decoding small batches does).

    python bench/async_rollouts.py --steps 4 --warmup 2 --repeats 2
    python bench/async_rollouts.py --size gsm8k --steps 2 --warmup 1 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from harness import add_common, child, engine, spread, table, write_section

SIZES = {  # the default run's step, and a GSM8K-sized one (longer completions, the CPPO paper's task)
    "default": ["task=arith"],
    "gsm8k": ["task=gsm8k", "train.max_completion_length=256", "train.max_prompt_length=256"],
}


def run_child(args: argparse.Namespace) -> dict:
    """In a fresh process: the arm's engine, warm-up steps, then timed steps; one JSON line of what it measured."""
    eng = engine(f"model.path={args.model}", *SIZES[args.size], f"train.max_staleness={args.k}",
                 f"train.steps={args.warmup + args.steps}", "optim.lr=1e-6", *args.set)
    for _ in range(args.warmup):
        eng.step()
    started = time.perf_counter()
    metrics = [eng.step() for _ in range(args.steps)]
    wall = time.perf_counter() - started
    eng.close()

    def total(*keys: str) -> float:
        return sum(m.get(k, 0.0) for m in metrics for k in keys) / len(metrics)

    return {"steps_per_s": args.steps / wall, "step_s": wall / args.steps,
            "generate_s": total("time/generate", "time/reward"),
            "train_s": total("time/logprobs", "time/update", "time/weight_sync"),
            "trainer_idle_s": total("time/trainer_idle"), "generator_idle_s": total("time/generator_idle"),
            "staleness": total("async/staleness_mean"), "rows": total("train/rows")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--size", choices=sorted(SIZES), default="default")
    p.add_argument("--ks", type=int, nargs="+", default=[1], help="the async arms' train.max_staleness")
    p.add_argument("--steps", type=int, default=4, help="timed steps per child")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per child first (the generator starts)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, default=0, help=argparse.SUPPRESS)
    add_common(p)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return

    arms = {"lockstep": 0, **{f"async-{k}": k for k in args.ks}}
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    for repeat in range(args.repeats):
        names = list(arms)
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            flags = ["--model", args.model, "--size", args.size, "--k", str(arms[name]), "--steps", str(args.steps),
                     "--warmup", str(args.warmup), *(["--set", *args.set] if args.set else [])]
            runs[name].append(child("async_rollouts.py", *flags, timeout=3600))
            print(name, runs[name][-1], file=sys.stderr, flush=True)

    def col(name: str, key: str) -> list[float]:
        return [r[key] for r in runs[name]]

    rows = [[name, spread(col(name, "step_s")), spread(col(name, "generate_s")), spread(col(name, "train_s")),
             spread(col(name, "trainer_idle_s")), spread(col(name, "generator_idle_s")),
             spread(col(name, "staleness")), f"{statistics.median(col(name, 'rows')):.0f}"] for name in arms]
    headers = ["arm", "step s", "generate+reward s", "logprobs+update+sync s", "trainer idle s", "generator idle s",
               "mean staleness", "rows trained"]
    lock = runs["lockstep"]
    g, t = statistics.median(col("lockstep", "generate_s")), statistics.median(col("lockstep", "train_s"))
    gains = [[f"{name} vs lockstep, measured", spread([a["step_s"] / b["step_s"] for a, b in
                                                        zip(lock, runs[name], strict=True)])]
             for name in arms if name != "lockstep"]
    gains.append(["model: a generator with devices of its own, (g + t) / max(g, t)", f"{(g + t) / max(g, t):.2f}"])
    body = table(headers, rows) + "\n\n" + table(["throughput gain", "x"], gains)
    print(body)
    note = (f"\n\nSizes: {args.model}, {args.size} ({' '.join(SIZES[args.size])}), the default run's B, G, pruner "
            f"and allocator; {args.warmup} warm-up and {args.steps} timed steps per child, {args.repeats} repeats "
            f"in rotating order; cells are median (min-max). g = {g:.2f} s and t = {t:.2f} s are the lockstep arm's "
            "phases. The async arms' generate and train columns are each process's own busy time on half the cores.")
    write_section("async", "Asynchronous rollouts: lockstep vs a generator running ahead", body + note, args,
                  variant="" if args.size == "default" else f"size={args.size}")


if __name__ == "__main__":
    main()
