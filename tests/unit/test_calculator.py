"""The built-in `calculator` tool: arithmetic worked out by hand, refusals of everything that is not arithmetic
(nothing is evaluated as code), and sizes bounded before they are computed."""

from __future__ import annotations

import pytest

from gpo.tasks.calculator import calculator
from gpo.tools import load_tools


@pytest.mark.parametrize("expression,expected", [
    ("1234 * 5678", "7006652"),  # 1234*5678 = 7006652
    ("2 + 3 * 4", "14"),  # precedence
    ("(2 + 3) * 4", "20"),
    ("7 / 2", "3.5"),
    ("6 / 3", "2"),  # an integer result has no ".0"
    ("2.5 * 4", "10"),
    ("0.1 + 0.2", "0.3"),  # decimals are exact: not 0.30000000000000004
    ("1 / 3", "0.333333333333"),  # 12 significant digits
    ("2 / 3", "0.666666666667"),
    ("-7 // 2", "-4"),  # floor division rounds down
    ("-7 % 3", "2"),  # Python's modulo takes the divisor's sign
    ("7.5 % 2", "1.5"),
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),
    ("2 ** 3 ** 2", "512"),  # right-associative: 2 ** 9
    ("-2 ** 2", "-4"),  # unary minus binds looser than **
    ("4 ** 0.5", "2"),
    ("2 ** 0.5", "1.41421356237"),  # sqrt(2) = 1.41421356237309...
    ("-(-3)", "3"),
    ("+5 - -5", "10"),
    ("1_000 * 3", "3000"),
    ("1.5e3 + 1", "1501"),
    ("  12  ", "12"),
    ("10 ** 300 // 10 ** 299", "10"),
])
def test_arithmetic(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression,message", [
    ("x + 1", "`x` is not arithmetic; allowed: numbers, \\+ - \\* / // % \\*\\* and parentheses"),
    ("__import__('os').system('true')", "is not arithmetic"),
    ("(lambda: 1)()", "is not arithmetic"),
    ("abs(-1)", "is not arithmetic"),
    ("[1, 2]", "is not arithmetic"),
    ("1 < 2", "is not arithmetic"),
    ("'a' * 3", "`'a'` is not a number"),
    ("True + 1", "`True` is not a number"),
    ("1j * 2", "`1j` is not a number"),
    ("2 ^ 3", "`\\^` \\(for a power write \\*\\*\\) is not allowed"),
    ("6 & 3", "`&` is not allowed"),
    ("1 +", "cannot read `1 \\+` as arithmetic"),
    ("", "empty expression"),
    ("1 / 0", "division by zero"),
    ("5 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** (1 / 3)", "not a real number"),
    ("1 + " * 200 + "1", "longer than 500 characters"),
])
def test_refusals_say_what_is_allowed(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


@pytest.mark.parametrize("expression", [
    "9 ** 9 ** 9",  # 9 ** 387420489: about 370 million digits, refused before computing
    "2 ** 10000000000",
    "10 ** 301 * 10",  # each factor fits, the product (302 digits, 1004 bits) does not
    "(1 / 2) ** 2000",  # too small is refused as well: the denominator has 2001 bits
    "1e308 * 10",  # past the float range
    "1.5 ** 1e6",
    "9" * 400,  # a 400-digit literal
])
def test_sizes_are_bounded(expression):
    with pytest.raises(ValueError, match="out of range"):
        calculator(expression)


def test_the_largest_result_allowed_prints_exactly():
    assert calculator("10 ** 300") == "1" + "0" * 300  # 997 bits, under the 1000-bit bound


def test_it_is_a_tool_the_model_can_be_shown():
    (tool,) = load_tools(["calculator"])
    assert (tool.name, tool.spec) == ("calculator", "calculator")
    function = tool.schema["function"]
    assert function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    assert function["description"].startswith("Evaluates an arithmetic expression")
