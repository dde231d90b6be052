"""`gpo run task=dataset` end to end: a JSONL file and a TRL-style reward function train the tiny model one step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REWARDS = '''
def short(completions, **kwargs):
    return [float(len(c) < 50) for c in completions]


def answered(prompts, completions, answer):
    return [float(a in c) if a else None for c, a in zip(completions, answer)]
'''


def test_one_training_step_on_a_jsonl_file_with_trl_style_rewards(tiny_model_path, tmp_path):
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in zip(range(8), range(3, 11))]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    out = tmp_path / "runs"
    command = [
        sys.executable, "-m", "gpo.cli", "run", f"model={tiny_model_path}", f"output_dir={out}", "tracker=none",
        "task=dataset", "task.path=train.jsonl", "task.grader=number", "task.validation_size=2",
        "task.rewards=[my_rewards:short,my_rewards:answered]", "task.reward_weights=[0.5,1.0]",
        "train.steps=1", "train.questions_per_step=2", "train.group_size=4", "train.max_completion_length=8",
        "train.micro_batch_size=4", "eval.before_and_after=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = "\n".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file() and p.suffix in
                       (".jsonl", ".json", ".txt", ".log", ".csv"))
    # The step's reward components are each function's, named after it, next to the grader's.
    for name in ("short", "answered", "accuracy", "format"):
        assert name in logged + done.stdout + done.stderr, name
