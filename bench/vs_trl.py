"""gpo's GRPO against TRL 1.16's GRPOTrainer: seconds per step and peak memory on the same model and questions.

Both sides get the same settings, set explicitly because TRL's defaults differ (beta 0, loss_type dapo, gradient
checkpointing on): the default model (SmolLM2-135M-Instruct, float32, CPU), the arith questions in the order gpo's
seeded stream draws them, G=8, B=4 questions per optimizer step in micro-batches of 16 completions, at most 48 new
tokens, T=1, top_p 1, top_k off, beta 0.04 (k3 KL, reference model loaded), loss_type grpo (= gpo's seq_mean),
mu 1, lr 1e-5, clip 0.2, transformers `generate` for sampling, no gradient checkpointing.
`--mixed-precision bf16` gives both bf16 autocast over float32 weights (TRL: `bf16=True`; gpo:
engine.mixed_precision=bf16), and `--rollout-precision` gpo's generator its precision (backend.precision;
TRL samples with the training model), so `--mixed-precision bf16 --rollout-precision int8` runs each framework
at its best precision on a CPU with bf16 and int8 instructions.
Each framework runs in its own process (clean peak RSS), alternated gpo, TRL, gpo, TRL, ...; a run times each
optimizer step after one warm-up step. Loss equality is checked separately, on fixed batches, by
tests/unit/test_trl_equivalence.py (TRL's own loss code against gpo's objectives); this script runs that file too.

    python bench/vs_trl.py --steps 3 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from harness import REPO, add_common, child, engine, peak_rss_mib, spread, table, write_section

SEED = 42


def run_gpo(args: argparse.Namespace) -> dict:
    eng = engine(f"model.path={args.model}", "task=arith", "algo=grpo", "algo.beta=0.04", "algo.loss_agg=seq_mean",
                 "pruner=none", "allocator=static", f"train.questions_per_step={args.questions}",
                 f"train.group_size={args.group}", f"train.max_completion_length={args.max_new}",
                 f"train.micro_batch_size={args.micro_batch}", "train.mu=1", f"train.steps={args.steps + 1}",
                 "optim.lr=1e-5", "optim.schedule=constant", "optim.warmup_ratio=0", f"seed={SEED}",
                 f"engine.mixed_precision={args.mixed_precision}", f"backend.precision={args.rollout_precision}",
                 *args.set)
    seconds, losses = [], []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        metrics = eng.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(metrics.get("loss/total", float("nan")))
    return {"seconds": seconds[1:], "peak_mib": peak_rss_mib(), "loss": losses}


def run_trl(args: argparse.Namespace) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gpo import registry
    from gpo.config import compose
    from gpo.models import load_policy, load_tokenizer
    from gpo.sampler import QuestionStream

    registry.load_builtins()
    task = registry.get("task", "arith").build()
    # the questions gpo's engine would draw, in its order; TRL then reads them without shuffling
    examples = QuestionStream(task.load("train"), SEED).take(args.questions * (args.steps + 1))
    data = Dataset.from_list([{"prompt": task.prompt(e), **e} for e in examples])

    def arith_reward(prompts, completions, **columns):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rows = [{k: columns[k][i] for k in examples[0]} for i in range(len(texts))]
        return task.reward(texts, rows).total

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds.append(time.perf_counter() - self.t0)

    model_cfg = compose([f"model.path={args.model}", "tracker=none"]).model
    tokenizer = load_tokenizer(model_cfg)
    accumulation = args.questions * args.group // args.micro_batch
    config = GRPOConfig(
        output_dir=str(REPO / "runs" / "bench-trl"), use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=args.steps + 1, seed=SEED, shuffle_dataset=False,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=args.group, max_completion_length=args.max_new,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.04, loss_type="grpo", num_iterations=1, epsilon=0.2,
        scale_rewards="group", learning_rate=1e-5, lr_scheduler_type="constant",
        max_grad_norm=1.0, gradient_checkpointing=False, use_vllm=False, bf16=args.mixed_precision == "bf16",
    )
    clock = StepClock()
    trainer = GRPOTrainer(model=load_policy(model_cfg), reward_funcs=arith_reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"seconds": clock.seconds[1:], "peak_mib": peak_rss_mib(), "loss": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run, after one warm-up step")
    p.add_argument("--repeats", type=int, default=2, help="runs per framework, alternated")
    p.add_argument("--mixed-precision", choices=["no", "bf16"], default="no", help="both frameworks' updates")
    p.add_argument("--rollout-precision", choices=["float32", "bf16", "int8"], default="float32",
                   help="gpo's generator (TRL generates with the training model)")
    add_common(p)
    p.add_argument("--child", choices=["gpo", "trl"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps((run_gpo if args.child == "gpo" else run_trl)(args)))
        return

    passthrough = ["--model", args.model, "--questions", str(args.questions), "--group", str(args.group),
                   "--max-new", str(args.max_new), "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
                   "--mixed-precision", args.mixed_precision, "--rollout-precision", args.rollout_precision,
                   *(["--set", *args.set] if args.set else [])]
    runs: dict[str, list[dict]] = {"gpo": [], "trl": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(child("vs_trl.py", name, *passthrough))
            print(name, runs[name][-1], flush=True)
    step = {n: [statistics.median(r["seconds"]) for r in rs] for n, rs in runs.items()}
    peak = {n: [r["peak_mib"] for r in rs] for n, rs in runs.items()}
    ratio = [g / t for g, t in zip(step["gpo"], step["trl"])]  # paired: the gpo run and the TRL run after it
    body = table(["", "s / step (median per run)", "peak RSS MiB", "all step times s"], [
        [n, spread(step[n]), spread(peak[n]), " ".join(f"{s:.1f}" for r in runs[n] for s in r["seconds"])]
        for n in runs
    ])
    body += (f"\n\ngpo / TRL step time: {spread(ratio)} (target <= 0.80); peak RSS gpo / TRL: "
             f"{statistics.median(peak['gpo']) / statistics.median(peak['trl']):.2f} (target <= 1.00).")
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/unit/test_trl_equivalence.py"], capture_output=True, text=True, cwd=REPO)
    verdict = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else tests.stderr[-300:]
    body += f"\n\nLoss check on fixed batches, `pytest tests/unit/test_trl_equivalence.py`: {verdict}"
    print(body)
    note = (f"\n\nSizes: B={args.questions} questions x G={args.group} per optimizer step, micro-batch "
            f"{args.micro_batch} (TRL: per_device_train_batch_size={args.micro_batch}, gradient_accumulation_steps = "
            f"steps_per_generation = {args.questions * args.group // args.micro_batch}), {args.steps} timed steps "
            f"after 1 warm-up per run, {args.repeats} runs per framework alternated. A step is timed from the "
            "trainer's step start to its end (TRL: on_step_begin/on_step_end, which includes its generation; gpo: "
            "Engine.step). Peak RSS is the whole child process (model load included), both loading a policy and a "
            "reference copy. Sampling differs between the frameworks (different RNG use), so completion lengths, "
            "and with them step times, differ a little from step to step.")
    precision = "" if (args.mixed_precision, args.rollout_precision) == ("no", "float32") else (
        f"mixed_precision {args.mixed_precision}, rollouts {args.rollout_precision}")
    write_section("vs_trl", "gpo vs TRL GRPOTrainer: step time and peak memory", body + note, args, precision)


if __name__ == "__main__":
    main()
