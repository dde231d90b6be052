"""Phase speedup of CPPO pruning: the post-generation phases (reference log-probs and the update) on one fixed batch
of generated completions, with the top-k pruner at each rate P, side by side in one process.

CPPO's claim for these phases is a speedup of up to 1/(1-P): only the kept rows reach a forward pass. The batch
is generated once (default model and task, G=8); each repeat then runs P = 0, 0.5, 0.75, 0.875 in turn on the
same batch, so load from other jobs hits every P alike, and speedups are paired within a repeat.
Each P runs twice per repeat: with prompt sharing (the default, `train.share_prompt`: one decoder pass per distinct
prompt in a micro-batch) and without it (every row recomputes its prompt, as in the CPPO paper's code and in TRL).
Sharing makes the prompt a per-group cost that pruning rows cannot remove, so it lowers CPPO's ratio to P=0 while
lowering every absolute time; both are reported.
`--memory` also runs each P in its own process and reports the peak RSS of the post-generation phases.

    python bench/phases.py --questions 4 --repeats 3 --memory
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from harness import add_common, child, engine, peak_rss_mib, spread, table, write_section

RATES = [0.0, 0.5, 0.75, 0.875]


def build(args: argparse.Namespace):
    """The engine and one generated, rewarded batch (same seed, so every process gets the same batch)."""
    from gpo.metrics import PhaseTimer

    eng = engine(f"model.path={args.model}", "task=arith", "algo=grpo", f"algo.beta={args.beta}", "pruner=none",
                 "allocator=static", f"train.questions_per_step={args.questions}", f"train.group_size={args.group}",
                 f"train.max_completion_length={args.max_new}", f"train.micro_batch_size={args.micro_batch}",
                 f"train.mu={args.mu}", "train.steps=1000", "optim.warmup_ratio=0", *args.set)
    return eng, eng.rollout.produce(0, 0, PhaseTimer()).rows  # every row: the arms prune it themselves


def pruned(eng, batch, rate: float):
    from gpo import registry

    pruner = registry.get("pruner", "topk").build({"rate": rate})
    return batch.select(pruner.keep(batch))


def set_sharing(eng, on: bool) -> None:
    """Switch prompt sharing in the policy's and the reference's log-prob modules."""
    for module in (eng.module, eng.ref):
        if module is not None:
            eng.accelerator.unwrap_model(module).share_prompt = on


def decoder_positions(kept, micro_batch: int, shared: bool) -> int:
    """Padded positions the decoder processes for `kept`: per micro-batch, rows x (Lp + L) without sharing,
    distinct prompts x Lp + rows x L with it (the work model behind the `token ideal` column)."""
    from gpo.logprobs import distinct_prompts, micro_batches

    total = 0
    for mb in micro_batches(kept, micro_batch):
        prompts = len(distinct_prompts(mb.prompt_ids, mb.prompt_mask)[0]) if shared else len(mb)
        total += prompts * mb.prompt_ids.shape[1] + len(mb) * mb.completion_ids.shape[1]
    return total


def timed_phases(eng, kept) -> tuple[float, float]:
    """Seconds of the log-prob passes and of the update on `kept` (a fresh copy each time: fills mutate it)."""
    t0 = time.perf_counter()
    kept, mismatch = eng._fill_logprobs(kept)
    t1 = time.perf_counter()
    eng._update(kept, mismatch)
    return t1 - t0, time.perf_counter() - t1


def memory_child(args: argparse.Namespace) -> dict:
    """In a fresh process: generate, reset the peak-RSS mark, run the post-generation phases once at P."""
    eng, batch = build(args)
    whole_before = peak_rss_mib()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    timed_phases(eng, pruned(eng, batch, args.rate))
    hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM")) / 1024
    return {"phases_peak_mib": hwm, "process_peak_mib": max(whole_before, peak_rss_mib()),
            "generation_peak_mib": whole_before}


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
    p.add_argument("--memory", action="store_true", help="also peak RSS per P, each in its own process")
    add_common(p)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import json

        print(json.dumps(memory_child(args)))
        return

    eng, batch = build(args)
    kept = {P: pruned(eng, batch, P) for P in RATES}
    modes = [True, False]  # prompt sharing on (default), off
    seconds: dict[tuple[bool, float], list[float]] = {(on, P): [] for on in modes for P in RATES}
    split: dict[tuple[bool, float], tuple[list[float], list[float]]] = {  # (log-prob, update) seconds
        (on, P): ([], []) for on in modes for P in RATES}
    for repeat in range(args.repeats):
        for on in (modes if repeat % 2 == 0 else modes[::-1]):
            set_sharing(eng, on)
            for P in RATES:
                # An untimed run of the same P first (the warm-up): each timed run is in steady state for its
                # shapes, and first-call allocations are not part of any P.
                timed_phases(eng, kept[P].to("cpu"))
                lp, up = timed_phases(eng, kept[P].to("cpu"))
                seconds[on, P].append(lp + up)
                split[on, P][0].append(lp)
                split[on, P][1].append(up)
    set_sharing(eng, True)
    rows = []
    for on in modes:
        for P in RATES:
            ratios = [a / b for a, b in zip(seconds[on, 0.0], seconds[on, P])]  # paired within a repeat
            speedup, ideal = statistics.median(ratios), 1 / (1 - P)
            tokens = int(kept[P].completion_mask.sum())
            work_ideal = (decoder_positions(kept[0.0], args.micro_batch, on)
                          / decoder_positions(kept[P], args.micro_batch, on))
            sharing_gain = [a / b for a, b in zip(seconds[False, P], seconds[True, P])]
            rows.append(["on" if on else "off", P, len(kept[P]), tokens, spread(split[on, P][0]),
                         spread(split[on, P][1]), spread(seconds[on, P]), spread(ratios), f"{ideal:.2f}",
                         f"{100 * speedup / ideal:.0f}%", f"{work_ideal:.2f}", f"{100 * speedup / work_ideal:.0f}%",
                         spread(sharing_gain) if on else "-"])
    headers = ["prompt sharing", "P", "rows", "tokens", "logprobs s", "update s", "total s", "speedup vs P=0",
               "ideal 1/(1-P)", "% of ideal", "token ideal", "% of token ideal", "sharing speedup"]
    body = table(headers, rows)
    if args.memory:
        mem = [[P, *(f"{v:.0f}" for v in child("phases.py", *_child_args(args), "--rate", str(P)).values())]
               for P in RATES]
        body += "\n\nPeak RSS (MiB), each P in its own process:\n\n" + table(
            ["P", "post-generation phases", "whole process", "until end of generation"], mem)
    print(body)
    lengths = batch.lengths.float()
    note = (f"\n\nBatch: B={args.questions} questions x G={args.group} = {len(batch)} completions of the "
            f"{eng.cfg.task.name} task from {args.model}, at most {args.max_new} new tokens (mean length "
            f"{lengths.mean():.1f}, {int(batch.truncated.sum())} truncated); mu={args.mu}, beta={args.beta} "
            f"(reference pass on), micro-batch {args.micro_batch}. {args.repeats} repeats, P interleaved within "
            "each repeat, each timed run right after an untimed run of the same P (warm-up and steady state); cells "
            "are median (min-max); speedups are paired within a repeat. `token ideal` = padded decoder positions at "
            "P=0 / at P (prompt counted once per distinct prompt per micro-batch when shared): the speedup pruning "
            "could give if time followed decoder work. It differs from 1/(1-P) because top-k keeps the largest "
            "|advantage|, not an average-length sample, and, with sharing, because a prompt is paid once per group "
            "whatever the number of rows kept. "
            "`sharing speedup` = time without sharing / with it, at the same P, paired within a repeat."
            + (" Memory is measured with sharing on (the default)." if args.memory else ""))
    write_section("phases", "Phase speedup: log-probs + update on one fixed batch, by pruning rate P", body + note,
                  args)


def _child_args(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--questions", str(args.questions), "--group", str(args.group), "--max-new",
            str(args.max_new), "--micro-batch", str(args.micro_batch), "--mu", str(args.mu), "--beta", str(args.beta),
            "--set", *args.set]


if __name__ == "__main__":
    main()
