"""`gpo eval`: greedy accuracy of a model on a task's split, with a per-example report.

Fixes relative to the CPPO reference's evaluation (reference section 5 and 8.9): every example is scored (the
reference dropped the last partial batch: 1,312 of GSM8K's 1,319), completions stay aligned with their own
examples (no de-duplication of prompts), and grading uses the task's training verifier instead of a laxer one.
The engine calls `evaluate` for validation during training; `evaluate_from_args` is the command line around it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpo.errors import UserError
from gpo.types import Backend, Example, Sampling, Task

# `gpo eval` shorthands -> config keys. A bare `gpo eval` scores the whole test split, unlike validation
# during training (eval.split=validation, eval.limit from base.yaml).
SHORTHANDS = {"split": "eval.split", "limit": "eval.limit"}
CLI_DEFAULTS = ["eval.split=test", "eval.limit=0"]
EVAL_SEED = 0  # greedy decoding ignores it; passed because backends take one


def evaluate(model: Any, tokenizer: Any, backend: Backend, task: Task, examples: Sequence[Example],
             sampling: Sampling, batch_size: int, max_prompt_length: int = 1024) -> tuple[list[dict], dict]:
    """Generate one completion per example in batches of `batch_size` and grade them all.

    Returns per-example records (prompt, completion, extracted answer, gold, correct, formatted, length) and a
    summary (n, accuracy, format_rate, mean_completion_length, truncated_rate). `model` is the policy the
    backend generates with; it is put in eval mode for the duration and restored afterwards.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    from gpo.rollout import decode_completions, encode_prompts

    was_training = bool(getattr(model, "training", False))
    if hasattr(model, "eval"):
        model.eval()
    records: list[dict] = []
    try:
        for lo in range(0, len(examples), batch_size):  # the last, partial batch is scored too
            batch = list(examples[lo:lo + batch_size])
            prompt_ids = encode_prompts(tokenizer, [task.prompt(ex) for ex in batch], max_prompt_length)
            completion_ids = backend.generate(prompt_ids, 1, sampling, EVAL_SEED)  # [b] token id lists
            texts = decode_completions(tokenizer, completion_ids)
            for i, (ids, text, grade) in enumerate(zip(completion_ids, texts, task.grade(texts, batch), strict=True)):
                records.append({
                    "index": lo + i,
                    "prompt": tokenizer.decode(prompt_ids[i], skip_special_tokens=False),
                    "completion": text,
                    "extracted": grade.extracted,
                    "gold": grade.gold,
                    "correct": grade.correct,
                    "formatted": grade.formatted,
                    "completion_tokens": len(ids),
                    "truncated": tokenizer.eos_token_id not in ids,
                })
    finally:
        if was_training:
            model.train()
    return records, summarise(records)


def summarise(records: Sequence[dict]) -> dict[str, float]:
    n = len(records)

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in records) / n if n else 0.0

    return {
        "n": n,
        "accuracy": mean("correct"),
        "format_rate": mean("formatted"),
        "mean_completion_length": mean("completion_tokens"),
        "truncated_rate": mean("truncated"),
    }


def expand_shorthands(args: Sequence[str]) -> list[str]:
    """`split=test limit=20` -> `eval.split=test eval.limit=20`, after the CLI defaults so the user's win."""
    out = list(CLI_DEFAULTS)
    for arg in args:
        key, sep, value = arg.partition("=")
        out.append(f"{SHORTHANDS[key]}={value}" if sep and key in SHORTHANDS else arg)
    return out


def evaluate_from_args(args: list[str], config_files: list[str]) -> int:
    """`gpo eval model=PATH task=NAME [split=test] [limit=N] [backend=hf] [key=value ...]`."""
    from gpo import registry
    from gpo.config import compose, section, to_object, to_yaml
    from gpo.models import load_policy, load_tokenizer

    cfg = compose(expand_shorthands(args), config_files)
    ev, train = section(cfg, "eval"), section(cfg, "train")
    if ev.limit < 0:
        raise UserError(f"limit must be >= 0 (0 = the whole split), got {ev.limit}.")
    task = registry.get("task", cfg.task.name).build(to_object("task", cfg.task))
    examples = list(task.load(ev.split))
    if ev.limit:
        examples = examples[:ev.limit]

    model_cfg = section(cfg, "model")
    tokenizer = load_tokenizer(model_cfg)
    model = load_policy(model_cfg, trainable=False)
    backend = registry.get("backend", cfg.backend.name).build(
        to_object("backend", cfg.backend), model=model, tokenizer=tokenizer)
    sampling = Sampling(max_new_tokens=ev.max_new_tokens or train.max_completion_length, greedy=True)

    started = time.time()
    records, summary = evaluate(model, tokenizer, backend, task, examples, sampling, ev.batch_size,
                                train.max_prompt_length)
    summary = {"task": cfg.task.name, "split": ev.split, "model": model_cfg.path, **summary,
               "seconds": round(time.time() - started, 2)}

    stamp = time.strftime("%Y%m%d-%H%M%S")
    name, run_dir = _new_run_dir(Path(cfg.output_dir), f"eval-{cfg.task.name}-{ev.split}-{stamp}")
    report = run_dir / "examples.jsonl"
    with open(report, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    summary_file = run_dir / "summary.json"
    summary_file.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")

    tracker = registry.get("tracker", cfg.tracker.name).build(to_object("tracker", cfg.tracker), run_dir=run_dir)
    tracker.start(name, {"task": cfg.task.name, "split": ev.split, "model": model_cfg.path,
                         "limit": ev.limit, "max_new_tokens": sampling.max_new_tokens}, to_yaml(cfg))
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
