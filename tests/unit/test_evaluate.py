"""The reusable `evaluate` on scripted completions: every example scored, pass@k / maj@k by hand, settings
checked. `gpo eval` as a process and evaluation inside training runs: tests/integration/test_evaluate_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpo.errors import UserError
from gpo.evaluate import evaluate, expand_shorthands, pass_at_k, pass_ks
from gpo.tasks.arith import Arith, ArithConfig
from gpo.types import Sampling

# Token id -> text for the fake tokenizer; 0 is EOS.
VOCAB = {0: "", 1: "<prompt>", 5: "<answer>8</answer>", 6: "7", 7: "so 8", 8: "hmm", 9: "<answer>8.0</answer>"}


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


def test_gpo_eval_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from gpo.cli import main

    assert main(["eval", "task=arith", "limit=-1", "tracker=none", f"output_dir={tmp_path}"]) == 2
    assert "`eval.limit` must be >= 0" in capsys.readouterr().err


# --- sampled evaluation ---------------------------------------------------------------------------------------


def test_pass_at_k_is_the_unbiased_estimator():
    # n=4 samples, c correct: 1 - C(4-c, k) / C(4, k), worked by hand
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)=3, C(4,2)=6
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # C(2,2)=1
    assert pass_at_k(4, 3, 2) == 1.0 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(5, 2, 2) == pytest.approx(0.7)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_pass_at_k_is_stable_where_the_binomials_are_huge():
    from fractions import Fraction
    from math import comb

    for n, c, k in [(200, 100, 50), (1000, 3, 500), (1000, 999, 1), (64, 0, 64), (300, 1, 299)]:
        exact = 1 - Fraction(comb(n - c, k), comb(n, k))  # Python's integers are exact: an independent reference
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)


def test_pass_k_defaults_to_powers_of_two_and_the_sample_count():
    assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1]
    assert pass_ks(8, [4, 1, 4]) == [1, 4]
    with pytest.raises(UserError, match="eval.pass_k values must be in 1..eval.samples"):
        pass_ks(4, [3, 9])


def test_sampled_evaluation_reports_pass_avg_and_majority() -> None:
    task = Arith(ArithConfig())
    examples = [{"question": "3 + 5?", "expression": "3 + 5", "gold": "8"}] * 2
    # question 0: answers 7, 8, none, none -> 1 correct; the vote ties 1-1 and goes to the first answer (7): wrong
    # question 1: answers 7, 8, 8.0, none -> 2 correct; 8 and 8.0 are one answer to the grader: 2 votes to 1, right
    backend = ScriptedBackend([[6, 0], [5, 0], [8, 0], [8, 0], [6, 0], [5, 0], [9, 0], [8, 0]])
    sampling = Sampling(max_new_tokens=8, temperature=0.7)
    records, summary = evaluate(None, FakeTokenizer(), backend, task, examples, sampling, batch_size=8, samples=4)
    assert [(size, n) for size, n, _ in backend.calls] == [(2, 4)]  # 8 completions per call: 2 questions x 4
    assert [(r["index"], r["sample"]) for r in records] == [(q, s) for q in range(2) for s in range(4)]
    assert summary["n"] == 2 and summary["samples"] == 4
    assert summary["accuracy"] == summary["avg_at_4"] == pytest.approx(3 / 8)
    assert summary["pass_at_1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert summary["pass_at_2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)
    assert summary["pass_at_4"] == 1.0
    assert summary["maj_at_4"] == 0.5


def test_sampling_settings_are_checked():
    from gpo.config import EvalConfig
    from gpo.evaluate import sampling_for

    assert sampling_for(EvalConfig(), 16).greedy  # greedy stays the default
    sampled = sampling_for(EvalConfig(samples=4, temperature=0.6, top_p=0.95), 16)
    assert (sampled.greedy, sampled.temperature, sampled.top_p, sampled.max_new_tokens) == (False, 0.6, 0.95, 16)
    with pytest.raises(UserError, match="eval.samples must be >= 1"):
        sampling_for(EvalConfig(samples=0), 16)
    with pytest.raises(UserError, match="eval.temperature > 0"):
        sampling_for(EvalConfig(samples=2, temperature=0.0), 16)


def test_unknown_final_tasks_fail_before_any_training():
    from gpo.config import compose

    with pytest.raises(UserError, match="unknown task `aime25`.*Did you mean `aime24`"):
        compose(["eval.tasks=[aime25]"])
