"""Mixed-precision updates: the post-generation phases (old-policy and reference log-probs, the update) of the
default step on one fixed batch, in float32 and in bf16 (engine.mixed_precision=bf16), interleaved.

One engine serves both arms (so both see the same weights and batch): the bf16 arm switches the log-prob
modules' autocast, which is what engine.mixed_precision=bf16 sets on a run without DeepSpeed (float32 weights and
AdamW state, the decoder under bf16 autocast, LM head and log-softmax in float32; docs/precision.md). Learning
rate 0 keeps the weights put. Each repeat runs no, bf16 (bf16, no on odd repeats), each timed run right after an
untimed one of the same arm. The `logp diff` column is bf16's log-probs against float32's on the batch's tokens.
bf16 is faster only where the hardware multiplies in bf16 (AVX-512 BF16 or AMX on CPU, a GPU); check
`torch.backends.cpu.get_cpu_capability()`.

    python bench/precision.py --questions 4 --repeats 3
    python bench/precision.py --mu 2    # the old-policy pass too
"""

from __future__ import annotations

import argparse
import time

from harness import add_common, engine, freeze_weights, spread, table, write_section

ARMS = ["no", "bf16"]


def build(args: argparse.Namespace):
    """The engine and the kept rows of one step's rollout (the default step's objective, no pruning)."""
    from gpo.metrics import PhaseTimer

    eng = engine(f"model.path={args.model}", "task=arith", "algo=grpo", f"algo.beta={args.beta}", "pruner=none",
                 "allocator=static", f"train.questions_per_step={args.questions}", f"train.group_size={args.group}",
                 f"train.max_completion_length={args.max_new}", f"train.micro_batch_size={args.micro_batch}",
                 f"train.mu={args.mu}", "train.steps=1000", "optim.warmup_ratio=0", *args.set)
    return eng, eng.rollout.produce(0, 0, PhaseTimer()).rows


def timed_phases(eng, kept) -> tuple[float, float]:
    """Seconds of the log-prob passes and of the update on `kept` (a fresh copy each time: fills mutate it)."""
    t0 = time.perf_counter()
    kept, mismatch = eng._fill_logprobs(kept)
    t1 = time.perf_counter()
    eng._update(kept, mismatch)
    return t1 - t0, time.perf_counter() - t1


def set_precision(eng, precision: str) -> None:
    """The autocast of the policy's and the reference's log-prob modules (what mixed_precision sets on them)."""
    for module in (eng.module, eng.ref):
        if module is not None:
            eng.accelerator.unwrap_model(module).precision = precision
    eng.logprob_precision = precision


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--questions", type=int, default=4, help="B questions, G completions each, generated once")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--mu", type=int, default=1)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient; > 0 runs the reference pass")
    p.add_argument("--repeats", type=int, default=3)
    add_common(p)
    args = p.parse_args()

    import torch

    from gpo.logprobs import batch_logprobs

    eng, batch = build(args)
    freeze_weights(eng)
    split: dict[str, tuple[list[float], list[float]]] = {arm: ([], []) for arm in ARMS}  # (log-prob, update) s
    logp = {}
    for arm in ARMS:
        set_precision(eng, arm)
        logp[arm] = batch_logprobs(eng.module, batch, args.micro_batch, eng.train_cfg.temperature)
    mask = batch.completion_mask.bool()
    diff = (logp["bf16"] - logp["no"]).abs()[mask]
    for repeat in range(args.repeats):
        for arm in (ARMS if repeat % 2 == 0 else ARMS[::-1]):
            set_precision(eng, arm)
            timed_phases(eng, batch.to("cpu"))  # warm-up of the same arm and shapes
            lp, up = timed_phases(eng, batch.to("cpu"))
            split[arm][0].append(lp)
            split[arm][1].append(up)
    total = {arm: [a + b for a, b in zip(*split[arm])] for arm in ARMS}
    speedup = [a / b for a, b in zip(total["no"], total["bf16"])]  # paired within a repeat
    rows = [[arm, spread(split[arm][0]), spread(split[arm][1]), spread(total[arm]),
             spread(speedup) if arm == "bf16" else "-",
             f"{float(diff.mean()):.4f} / {float(diff.max()):.3f}" if arm == "bf16" else "-"] for arm in ARMS]
    body = table(["mixed_precision", "logprobs s", "update s", "total s", "speedup vs no", "logp diff mean / max"],
                 rows)
    print(body)
    note = (f"\n\nBatch: B={args.questions} x G={args.group} = {len(batch)} completions of {eng.cfg.task.name} from "
            f"{args.model}, at most {args.max_new} new tokens, all trained (no pruning); mu={args.mu}, "
            f"beta={args.beta}, micro-batch {args.micro_batch}. {args.repeats} repeats, median (min-max); speedups "
            f"paired within a repeat. CPU capability: {torch.backends.cpu.get_cpu_capability()}.")
    write_section("precision", "Mixed precision: log-probs + update in float32 and bf16", body + note, args)


if __name__ == "__main__":
    main()
