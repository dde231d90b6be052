"""GSM8K rewards on real test rows: the paper's values (format 1; accuracy 2 exact, 1.5 numeric) with the
reference's bugs fixed (trailing text, negative numbers, `$` and commas)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpo.tasks.gsm8k import GSM8K, GSM8KConfig, accuracy, gold_answer

THINK = "<think>16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars</think>\n"


@pytest.fixture(scope="module")
def task(shared_data: Path) -> GSM8K:
    return GSM8K(GSM8KConfig(data_dir=str(shared_data)))


def test_loads_real_splits(task: GSM8K) -> None:
    # 7,473 train rows - 256 carved for validation = 7,217; test is untouched.
    assert (len(task.load("train")), len(task.load("validation")), len(task.load("test"))) == (7217, 256, 1319)
    questions = {ex["question"] for ex in task.load("train")}
    assert not questions & {ex["question"] for ex in task.load("validation")}
    assert task.load("test")[2]["gold"] == "70000"  # "#### 70000"


# Test row 0 (Janet's ducks), gold 18. total = 1 * format + 1 * accuracy.
@pytest.mark.parametrize(
    "completion, fmt, acc",
    [
        (THINK + "<answer>18</answer>", 1.0, 2.0),  # correct: 1 + 2 = 3
        (THINK + "<answer>$18</answer>", 1.0, 2.0),  # "$" dropped -> exact
        (THINK + "<answer>18.</answer>", 1.0, 2.0),  # final full stop dropped -> exact
        (THINK + "<answer>18 dollars</answer>", 1.0, 1.5),  # one number equal to the gold: 1 + 1.5 = 2.5
        (THINK + "<answer>18.00</answer>", 1.0, 1.5),  # numerically equal, not the same string
        (THINK + "<answer>9 + 9 = 18</answer>", 1.0, 0.0),  # three numbers: not a single numeric answer
        (THINK + "<answer>20</answer>", 1.0, 0.0),  # wrong but well formatted: 1
        (THINK + "<answer>18</answer>\nHope that helps!", 0.0, 2.0),  # trailing text fails the format: 2
        ("The answer is 18.", 0.0, 0.0),  # no answer tag: no accuracy either (the paper's rule)
        ("<think>16 - 3 - 4 = 9 eggs, 9 * 2 =", 0.0, 0.0),  # truncated
    ],
)
def test_reward_table(task: GSM8K, completion: str, fmt: float, acc: float) -> None:
    example = task.load("test")[0]
    rewards = task.reward([completion], [example])
    assert rewards.components == {"format": [fmt], "accuracy": [acc]}
    assert rewards.total == [fmt + acc]


def test_commas_and_big_numbers(task: GSM8K) -> None:
    example = task.load("test")[2]  # gold 70000
    completions = ["<think>x</think><answer>70,000</answer>", "<think>x</think><answer>$70,000.00</answer>",
                   "<think>x</think><answer>7,000</answer>"]
    # "70,000" -> "70000" exact (2); "$70,000.00" -> "70000.00" numerically equal (1.5); 7000 is wrong (0).
    assert task.reward(completions, [example] * 3).components["accuracy"] == [2.0, 1.5, 0.0]


def test_negative_answers_keep_their_sign() -> None:
    assert gold_answer("falls by 3 degrees\n#### -3") == "-3"
    assert accuracy("-3", "-3") == 2.0
    assert accuracy("it is -3 degrees", "-3") == 1.5  # the reference's regex read "3" and matched gold 3
    assert accuracy("3", "-3") == 0.0
    assert accuracy("\u22123", "-3") == 2.0  # unicode minus sign


def test_weights_and_grades(shared_data: Path) -> None:
    task = GSM8K(GSM8KConfig(data_dir=str(shared_data), format_weight=0.5, accuracy_weight=2.0))
    example = task.load("test")[0]
    completions = [THINK + "<answer>18 dollars</answer>", "<answer>18</answer>"]
    # 0.5 * 1 + 2 * 1.5 = 3.5 ; 0.5 * 0 + 2 * 2 = 4
    assert task.reward(completions, [example] * 2).total == [3.5, 4.0]
    grades = task.grade(completions, [example] * 2)
    assert [(g.extracted, g.gold, g.correct, g.formatted) for g in grades] == [
        ("18 dollars", "18", True, True), ("18", "18", True, False)]


def test_prompt_is_system_then_question(task: GSM8K) -> None:
    example = task.load("test")[0]
    messages = task.prompt(example)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "<think>" in messages[0]["content"] and "<answer>" in messages[0]["content"]
    assert messages[1]["content"] == example["question"]
