"""`gpo eval` and the reusable `evaluate`: every example scored, reports written, the tracker fed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpo.evaluate import evaluate, expand_shorthands
from gpo.tasks.arith import Arith, ArithConfig
from gpo.types import Sampling

REPO = Path(__file__).resolve().parents[1]

# Token id -> text for the fake tokenizer; 0 is EOS.
VOCAB = {0: "", 1: "<prompt>", 5: "<answer>8</answer>", 6: "7", 7: "so 8"}


class FakeTokenizer:
    eos_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [1, 1, 1]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(VOCAB[i] for i in ids)


class ScriptedBackend:
    """Returns the scripted completions in order and records each call's batch."""

    def __init__(self, completions: list[list[int]]) -> None:
        self.completions = list(completions)
        self.calls: list[tuple[int, int, Sampling]] = []

    def generate(self, prompts, n, sampling, seed):
        self.calls.append((len(prompts), n, sampling))
        out, self.completions = self.completions[: len(prompts) * n], self.completions[len(prompts) * n:]
        return out


def test_every_example_is_scored_including_the_last_partial_batch() -> None:
    task = Arith(ArithConfig())
    examples = [{"question": "3 + 5?", "expression": "3 + 5", "gold": "8"}] * 5
    # correct+tag+EOS, wrong (no EOS: truncated), correct+tag+EOS, correct by last number, wrong+EOS
    backend = ScriptedBackend([[5, 0], [6], [5, 0], [7, 0], [6, 6, 0]])
    sampling = Sampling(max_new_tokens=8, greedy=True)
    records, summary = evaluate(None, FakeTokenizer(), backend, task, examples, sampling, batch_size=2)
    assert [(size, n) for size, n, _ in backend.calls] == [(2, 1), (2, 1), (1, 1)]  # 5 = 2 + 2 + 1, none dropped
    assert all(s.greedy for _, _, s in backend.calls)
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["correct"] for r in records] == [True, False, True, True, False]
    assert records[3]["extracted"] == "8" and records[3]["gold"] == "8" and records[3]["completion"] == "so 8"
    assert summary == {
        "n": 5,
        "accuracy": 3 / 5,  # rows 0, 2, 3
        "format_rate": 2 / 5,  # rows 0, 2 carry an answer tag
        "mean_completion_length": (2 + 1 + 2 + 2 + 3) / 5,  # = 2.0 tokens
        "truncated_rate": 1 / 5,  # row 1 has no EOS
    }


def test_empty_split_gives_an_empty_summary() -> None:
    records, summary = evaluate(None, FakeTokenizer(), ScriptedBackend([]), Arith(ArithConfig()), [],
                                Sampling(max_new_tokens=4, greedy=True), batch_size=4)
    assert records == [] and summary["n"] == 0 and summary["accuracy"] == 0.0


def test_shorthands_map_to_eval_keys_after_the_cli_defaults() -> None:
    assert expand_shorthands(["task=gsm8k", "split=validation", "limit=20", "model.dtype=float32"]) == [
        "eval.split=test", "eval.limit=0",  # a bare `gpo eval` scores the whole test split
        "task=gsm8k", "eval.split=validation", "eval.limit=20", "model.dtype=float32",
    ]


def run_gpo_eval(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpo", "eval", *args, f"output_dir={tmp_path / 'runs'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_gpo_eval_end_to_end(tmp_path: Path, tiny_model_path: str, shared_data: Path) -> None:
    done = run_gpo_eval(tmp_path, f"model={tiny_model_path}", "task=gsm8k", "split=test", "limit=5", "tracker=none",
                        f"task.data_dir={shared_data}", "train.max_completion_length=8")
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs").glob("eval-gsm8k-test-*")
    rows = [json.loads(line) for line in (run_dir / "examples.jsonl").read_text().splitlines()]
    assert len(rows) == 5
    assert set(rows[0]) >= {"prompt", "completion", "extracted", "gold", "correct"}
    assert rows[0]["gold"] == "18"  # Janet's ducks, the first GSM8K test question
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["n"] == 5 and summary["split"] == "test" and 0.0 <= summary["accuracy"] <= 1.0
    assert '"accuracy"' in done.stdout  # the summary is printed


def test_gpo_eval_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from gpo.cli import main

    assert main(["eval", "task=arith", "limit=-1", "tracker=none", f"output_dir={tmp_path}"]) == 2
    assert "limit must be >= 0" in capsys.readouterr().err


def test_gpo_eval_logs_to_mlflow(tmp_path: Path, tiny_model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpo.evaluate import evaluate_from_args

    monkeypatch.chdir(tmp_path)
    assert evaluate_from_args([f"model={tiny_model_path}", "task=arith", "limit=3", "tracker=mlflow",
                               "train.max_completion_length=4", f"output_dir={tmp_path / 'runs'}"], []) == 0
    (run_dir,) = (tmp_path / "runs").glob("eval-arith-test-*")

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.metrics["n"] == 3
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"examples.jsonl", "summary.json"}
