"""arith: seeded, exact, adjustable; a lenient reward a 135M model can learn from."""

from __future__ import annotations

import pytest

from gpo import registry
from gpo.errors import UserError
from gpo.tasks.arith import Arith, ArithConfig


def test_same_seed_same_problems_and_splits_differ() -> None:
    a, b = Arith(ArithConfig()), Arith(ArithConfig())
    assert a.load("train")[:50] == b.load("train")[:50]
    assert [e["question"] for e in a.load("test")] != [e["question"] for e in a.load("train")[:500]]
    assert Arith(ArithConfig(seed=1)).load("test")[:20] != a.load("test")[:20]
    assert (len(a.load("train")), len(a.load("validation")), len(a.load("test"))) == (10000, 256, 500)


def test_default_is_one_digit_addition() -> None:
    for ex in Arith(ArithConfig()).load("test"):
        assert ex["question"] == f"What is {ex['expression']}?"
        x, op, y = ex["expression"].split()
        assert op == "+" and 0 <= int(x) <= 9 and 0 <= int(y) <= 9
        assert ex["gold"] == str(int(x) + int(y))


@pytest.mark.parametrize("digits, operations, operators", [(2, 3, ["+", "-", "*"]), (3, 2, ["-"]), (1, 4, ["*", "+"])])
def test_answers_are_exact(digits: int, operations: int, operators: list[str]) -> None:
    task = Arith(ArithConfig(digits=digits, operations=operations, operators=operators, style="story"))
    for ex in task.load("test"):
        # The expression is parenthesised to read left to right, so Python's precedence gives the same value.
        assert str(eval(ex["expression"])) == ex["gold"]  # noqa: S307 (our own generated arithmetic)
        assert ex["expression"].count(" ") == 2 * operations
        assert int(ex["gold"]) >= 0  # allow_negative=False
        assert ex["expression"] in ex["question"]


@pytest.mark.parametrize(
    "completion, fmt, acc",
    [
        ("<answer>8</answer>", 1.0, 1.0),  # 0.1 * 1 + 1 * 1 = 1.1
        ("3 + 5 = 8", 0.0, 1.0),  # no tag: the last number counts (lenient on purpose): 1.0
        ("<answer>7</answer> oops, 8", 1.0, 0.0),  # the tag wins over later numbers: 0.1
        ("<answer>eight</answer> 8", 1.0, 1.0),  # a tag without a number falls back to the last number: 1.1
        ("I think it is 9", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_reward_table(completion: str, fmt: float, acc: float) -> None:
    task = Arith(ArithConfig())
    example = {"question": "Ava has 3 apples. Ava gets 5 more. ...", "expression": "3 + 5", "gold": "8"}
    rewards = task.reward([completion], [example])
    assert rewards.components == {"format": [fmt], "accuracy": [acc]}
    assert rewards.total == [pytest.approx(0.1 * fmt + acc)]


def test_bad_config_is_a_user_error() -> None:
    """Choices and ranges are checked as the composer checks `task=arith task.KEY=...` (the config's annotations)."""
    build = registry.get("task", "arith").build
    with pytest.raises(UserError, match="operators"):
        build({"operators": ["/"]})
    with pytest.raises(UserError, match="operators"):
        Arith(ArithConfig(operators=()))  # nothing to draw from
    with pytest.raises(UserError, match="style"):
        build({"style": "poem"})
    with pytest.raises(UserError, match="digits"):
        build({"digits": 0})
    with pytest.raises(UserError, match="unknown split"):
        Arith(ArithConfig()).load("dev")
