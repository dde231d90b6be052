"""`gpo run task=dataset` on files with the user's own column names: only task.question_field / task.answer_field
set (the default template follows the question field), one training step on the tiny model; and templates typed in
bash as a user types them."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
QA = [(f"What is {a} + {b}?", str(a + b)) for a, b in zip(range(8), range(3, 11))]


def write_files(folder: Path) -> None:
    (folder / "mine.csv").write_text("q,a\n" + "".join(f"{q},{a}\n" for q, a in QA))
    (folder / "mine.jsonl").write_text("".join(json.dumps({"prompt": q, "solution": a, "Level Name": "easy"}) + "\n"
                                               for q, a in QA))


@pytest.mark.parametrize("names", [
    ["task.path=mine.csv", "task.question_field=q", "task.answer_field=a"],
    ["task.path=mine.jsonl", "task.question_field=prompt", "task.answer_field=solution",
     "task.user_template={question} ({Level Name})"],
], ids=["csv-q-a", "jsonl-prompt-solution"])
def test_one_training_step_with_the_users_column_names(tiny_model_path, tmp_path, names):
    write_files(tmp_path)
    out = tmp_path / "runs"
    command = [
        sys.executable, "-m", "gpo.cli", "run", f"model={tiny_model_path}", f"output_dir={out}", "tracker=none",
        "task=dataset", *names, "task.grader=number", "task.validation_size=2",
        "train.steps=1", "train.questions_per_step=2", "train.group_size=4", "train.max_completion_length=8",
        "train.micro_batch_size=4", "eval.before_and_after=false",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "missing column" not in done.stderr
    saved = [p for p in out.rglob("config.yaml")]
    assert saved, f"no run folder with a config.yaml under {out}"
    assert f"question_field: {names[1].partition('=')[2]}" in saved[0].read_text()


def bash_dry_run(folder: Path, typed: str) -> subprocess.CompletedProcess:
    """`gpo run ... --dry-run` typed into bash: `typed` is the rest of the line, exactly as a user types it."""
    line = (f"{shlex.quote(sys.executable)} -m gpo.cli run tracker=none backend=hf task=dataset task.path=mine.csv "
            f"task.question_field=q task.answer_field=a {typed} --dry-run")
    return subprocess.run(["bash", "-c", line], cwd=folder, capture_output=True, text=True, timeout=300, env=ENV)


@pytest.mark.parametrize("typed,kept", [
    ("task.user_template={q}", "user_template: '{q}'"),
    ("task.user_template='{q}'", "user_template: '{q}'"),
    ("'task.user_template=Question: {q}'", "user_template: 'Question: {q}'"),
    ("'task.user_template=\"{q}\"'", "user_template: '{q}'"),
])
def test_a_template_typed_in_bash_reaches_the_config(tmp_path, typed, kept):
    write_files(tmp_path)
    done = bash_dry_run(tmp_path, typed)
    assert done.returncode == 0, done.stderr
    assert kept in done.stdout


def test_a_template_naming_a_missing_column_exits_2_in_bash(tmp_path):
    write_files(tmp_path)
    done = bash_dry_run(tmp_path, "'task.user_template={q} ({level})'")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("gpo: error: task.user_template '{q} ({level})': `mine.csv` has no column `level`")
