"""`gpo eval`: accuracy of a model on a task's split, with a per-example report; greedy, or sampled.

A completion is correct when the task's `grade` says so, and a task grades by `gpo.types.passes` on its pass
criterion: the rule training's success rate, DAPO's filter and the selectors use, so accuracy, pass@k and maj@n
count the same completions right as training does.

Greedy (the default, eval.samples=1) scores one completion per question. Sampled (eval.samples=n, at
eval.temperature / eval.top_p) scores n per question and reports, besides `accuracy` (= avg@n, the mean over all
n completions):
- pass@k for each k of eval.pass_k (default 1, 2, 4, ... up to n): the unbiased estimator of Chen et al. 2021
  (arXiv 2107.03374), 1 - C(n-c, k) / C(n, k) for c correct of n, averaged over questions, computed as the
  product 1 - prod_{i=n-c+1..n} (1 - k/i), which never forms the huge binomials;
- maj@n: a majority vote over the extracted answers. Two answers are the same vote when the task's own grader
  says so (each completion graded with the other's answer as the gold, either way round), so `1/2` and `0.5`
  count together under math-verify; completions without an answer do not vote; a tie goes to the answer seen
  first; the question counts as correct when the winning answer is.

Fixes relative to the evaluation in the CPPO paper's released code (arXiv 2503.22342): every example is scored (the
reference dropped the last partial batch: 1,312 of GSM8K's 1,319), completions stay aligned with their own
examples (no de-duplication of prompts), and grading uses the task's training verifier instead of a laxer one.
The engine calls `evaluate` for validation during training; `evaluate_from_args` is the command line around it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpo import registry
from gpo.errors import UserError
from gpo.types import Backend, Example, Grade, Sampling, Task

if TYPE_CHECKING:
    from gpo.agent import Agent

# `gpo eval` shorthands -> config keys. A bare `gpo eval` scores the whole test split, unlike validation
# during training (eval.split=validation, eval.limit from EvalConfig).
SHORTHANDS = {"split": "eval.split", "limit": "eval.limit"}
CLI_DEFAULTS = ["eval.split=test", "eval.limit=0"]
EVAL_SEED = 0  # greedy decoding ignores it; passed because backends take one


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k), in product form."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(samples: int, wanted: Sequence[int] = ()) -> list[int]:
    """The k of pass@k: `wanted`, checked, else 1, 2, 4, ... and `samples` itself."""
    if wanted:
        bad = [k for k in wanted if not 1 <= k <= samples]
        if bad:
            raise UserError(f"eval.pass_k values must be in 1..eval.samples ({samples}), got {bad}.")
        return sorted(set(wanted))
    ks = [2**i for i in range(samples.bit_length()) if 2**i <= samples]
    return ks if ks[-1] == samples else [*ks, samples]


def majority_vote(task: Task, completions: Sequence[str], grades: Sequence[Grade], example: Example) -> int | None:
    """The index of a completion holding the most voted answer (see module doc), None when none has an answer."""
    reps: list[int] = []  # one completion per distinct answer, in order of first appearance
    answers: list[str] = []  # reps' extracted answers, stripped
    votes: list[int] = []
    for i, grade in enumerate(grades):
        if grade.extracted is None:
            continue
        answer = grade.extracted.strip()
        match = next((j for j, known in enumerate(answers) if known == answer), None)
        if match is None and reps:
            # Graded both ways round: a grader may normalise the prediction more than the gold (gsm8k drops `$`).
            pairs = [(i, r) for r in reps] + [(r, i) for r in reps]
            same = task.grade([completions[a] for a, _ in pairs],
                              [{**example, "gold": grades[b].extracted} for _, b in pairs])
            hits = [j for j in range(len(reps)) if same[j].correct or same[len(reps) + j].correct]
            match = hits[0] if hits else None
        if match is None:
            reps.append(i)
            answers.append(answer)
            votes.append(1)
        else:
            votes[match] += 1
    if not reps:
        return None
    return reps[max(range(len(reps)), key=lambda j: (votes[j], -j))]


def sampling_for(ev: Any, default_max_new_tokens: int) -> Sampling:
    """Greedy for eval.samples=1, else sampling at eval.temperature / eval.top_p."""
    if ev.samples < 1:
        raise UserError(f"eval.samples must be >= 1, got {ev.samples}.")
    max_new = ev.max_new_tokens or default_max_new_tokens
    if ev.samples == 1:
        return Sampling(max_new_tokens=max_new, greedy=True)
    if ev.temperature <= 0 or not 0 < ev.top_p <= 1:
        raise UserError(f"sampled evaluation needs eval.temperature > 0 and eval.top_p in (0, 1], got "
                        f"{ev.temperature} and {ev.top_p}.")
    return Sampling(max_new_tokens=max_new, temperature=ev.temperature, top_p=ev.top_p)


def evaluate(model: Any, tokenizer: Any, backend: Backend, task: Task, examples: Sequence[Example],
             sampling: Sampling, batch_size: int, max_prompt_length: int = 1024, samples: int = 1,
             pass_k: Sequence[int] = (), agent: Agent | None = None) -> tuple[list[dict], dict]:
    """Generate `samples` completions per example, `batch_size` completions per call, and grade them all. With an
    `agent` (the task's tools and environment) each completion is a trajectory, graded on its last model turn.

    Returns per-completion records (index, sample, prompt, completion, extracted answer, gold, correct,
    formatted, length) and a summary (n questions, accuracy, format_rate, mean_completion_length,
    truncated_rate; with samples > 1 also pass_at_K, avg_at_N, maj_at_N). `model` is the policy the backend
    generates with; it is put in eval mode for the duration and restored afterwards.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if samples < 1:
        raise UserError(f"eval.samples must be >= 1, got {samples}.")
    from gpo.agent import Turns, roll_out
    from gpo.generation import decode_completions, encode_prompts

    ks = pass_ks(samples, pass_k) if samples > 1 else []
    per_call = max(1, batch_size // samples)  # questions per generate call
    majority: list[bool] = []

    was_training = bool(getattr(model, "training", False))
    if hasattr(model, "eval"):
        model.eval()
    records: list[dict] = []
    try:
        for lo in range(0, len(examples), per_call):  # the last, partial batch is scored too
            batch = list(examples[lo:lo + per_call])
            conversations = [task.prompt(ex) for ex in batch]
            # [b * samples] token id lists, each question's samples together; the seed is fixed, so evaluations
            # before and after training draw from the same random stream
            if agent is None:
                prompt_ids = encode_prompts(tokenizer, conversations, max_prompt_length)
                completion_ids = backend.generate(prompt_ids, samples, sampling, EVAL_SEED + lo)
                texts = decode_completions(tokenizer, completion_ids)
                truncated = [tokenizer.eos_token_id not in ids for ids in completion_ids]
            else:
                done = roll_out(agent, Turns(tokenizer, agent.schemas), backend, batch, conversations, samples,
                                sampling, EVAL_SEED + lo, max_prompt_length)
                prompt_ids = [r.prompt for r in done.rows[::samples]]
                completion_ids, texts = [r.tokens for r in done.rows], done.answers
                truncated = [r.truncated for r in done.rows]
            grades = task.grade(texts, [ex for ex in batch for _ in range(samples)])
            for i, (ids, text, grade, cut) in enumerate(zip(completion_ids, texts, grades, truncated, strict=True)):
                q = i // samples
                records.append({
                    "index": lo + q,
                    "sample": i % samples,
                    "prompt": tokenizer.decode(prompt_ids[q], skip_special_tokens=False),
                    "completion": text,
                    "extracted": grade.extracted,
                    "gold": grade.gold,
                    "correct": grade.correct,
                    "formatted": grade.formatted,
                    "completion_tokens": len(ids),
                    "truncated": cut,
                })
            if samples > 1:
                for q, ex in enumerate(batch):
                    rows = slice(q * samples, (q + 1) * samples)
                    winner = majority_vote(task, texts[rows], grades[rows], ex)
                    majority.append(winner is not None and grades[q * samples + winner].correct)
    finally:
        if was_training:
            model.train()
    return records, summarise(records, samples, ks, majority)


def summarise(records: Sequence[dict], samples: int = 1, ks: Sequence[int] = (),
              majority: Sequence[bool] = ()) -> dict[str, float]:
    """Means over every completion; with several samples per question also pass@k, avg@n and maj@n."""
    total = len(records)

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in records) / total if total else 0.0

    questions = total // samples
    summary = {
        "n": questions,
        "accuracy": mean("correct"),
        "format_rate": mean("formatted"),
        "mean_completion_length": mean("completion_tokens"),
        "truncated_rate": mean("truncated"),
    }
    if samples > 1:
        correct = [sum(bool(r["correct"]) for r in records[q * samples:(q + 1) * samples]) for q in range(questions)]
        per = max(questions, 1)
        summary.update({f"pass_at_{k}": sum(pass_at_k(samples, c, k) for c in correct) / per for k in ks})
        summary[f"avg_at_{samples}"] = sum(correct) / (samples * per)
        summary[f"maj_at_{samples}"] = sum(majority) / per
        summary["samples"] = samples
    return summary


def final_tasks(cfg: Any, own_task: Task) -> list[tuple[str, Task]]:
    """eval.tasks as (name, task) pairs: the run's own task name is `own_task` (its settings); any other is built
    from its shipped YAML, with the run task's `data_dir` when both have that field (one local copy of the data)."""
    from gpo.config import component

    out = []
    for name in cfg.eval.tasks:
        if name == cfg.task.name:
            out.append((name, own_task))
            continue
        data_dir = getattr(cfg.task.config, "data_dir", None)
        shares_data = data_dir and "data_dir" in registry.get("task", name).defaults()
        out.append((name, registry.build(component("task", name, **({"data_dir": data_dir} if shares_data else {})))))
    return out


def expand_shorthands(args: Sequence[str]) -> list[str]:
    """`split=test limit=20` -> `eval.split=test eval.limit=20`, after the CLI defaults so the user's win."""
    out = list(CLI_DEFAULTS)
    for arg in args:
        key, sep, value = arg.partition("=")
        out.append(f"{SHORTHANDS[key]}={value}" if sep and key in SHORTHANDS else arg)
    return out


def evaluate_from_args(args: list[str], config_files: list[str]) -> int:
    """`gpo eval model=PATH task=NAME [split=test] [limit=N] [backend=hf] [key=value ...]`."""
    from gpo.build import build_parts
    from gpo.config import compose, to_yaml

    cfg = compose(expand_shorthands(args), config_files)
    ev, train = cfg.eval, cfg.train
    parts = build_parts(cfg, trainable=False)
    try:
        examples = list(parts.task.load(ev.split))
        if ev.limit:
            examples = examples[:ev.limit]
        sampling = sampling_for(ev, train.max_completion_length)
        started = time.time()
        records, summary = evaluate(parts.policy, parts.tokenizer, parts.backend, parts.task, examples, sampling,
                                    ev.batch_size, train.max_prompt_length, ev.samples, ev.pass_k, agent=parts.agent)
    finally:
        parts.close()
    summary = {"task": cfg.task.name, "split": ev.split, "model": cfg.model.path, **summary,
               "seconds": round(time.time() - started, 2)}

    stamp = time.strftime("%Y%m%d-%H%M%S")
    name, run_dir = _new_run_dir(Path(cfg.output_dir), f"eval-{cfg.task.name}-{ev.split}-{stamp}")
    report = run_dir / "examples.jsonl"
    with open(report, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    summary_file = run_dir / "summary.json"
    summary_file.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")

    tracker = registry.build(cfg.tracker, run_dir=run_dir)
    tracker.start(name, {"task": cfg.task.name, "split": ev.split, "model": cfg.model.path,
                         "limit": ev.limit, "max_new_tokens": sampling.max_new_tokens, "samples": ev.samples},
                  to_yaml(cfg))
    tracker.log_metrics({k: float(v) for k, v in summary.items() if isinstance(v, (int, float))}, step=0)
    tracker.log_artifact(str(report))
    tracker.log_artifact(str(summary_file))
    tracker.end()

    print(json.dumps(summary, indent=2))
    print(f"per-example report: {report}")
    return 0


def _new_run_dir(root: Path, name: str) -> tuple[str, Path]:
    """A fresh directory `root/name` (`name-2`, ... when two evaluations start within the same second)."""
    for attempt in range(1, 1000):
        candidate = name if attempt == 1 else f"{name}-{attempt}"
        try:
            (root / candidate).mkdir(parents=True, exist_ok=False)
            return candidate, root / candidate
        except FileExistsError:
            continue
    raise UserError(f"cannot create a fresh evaluation directory under `{root}`.")
