"""The built-in tool `calculator` (`task.tools=[calculator]`): arithmetic the model can hand off instead of doing it
in its head.

The expression is parsed with `ast` and only these nodes are walked: numbers (integers and decimals), the binary
operators + - * / // % **, unary minus and plus, and parentheses (which the parser folds away). Anything else (a
name, a call, an attribute, a string, a comparison, `^`) is refused with a ValueError that says what is allowed;
nothing is ever handed to `eval` or `exec`, so no text the model writes can run as code.

Numbers are exact fractions wherever the arithmetic allows (a decimal literal is read from its digits, so
0.1 + 0.2 is 0.3), and floats only once a power has a fractional exponent. Sizes are bounded before they are
computed: a power whose result would pass `MAX_BITS` bits (numerator or denominator), such as 9**9**9, is refused
rather than left to run for hours, and so is any intermediate result that large. An integer result prints without
".0"; any other prints rounded to `DIGITS` significant digits.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction

MAX_LENGTH = 500  # characters of an expression; also keeps the parse tree shallow enough to walk
MAX_BITS = 1000  # bits of a result's numerator or denominator (about 300 decimal digits)
DIGITS = 12  # significant digits of a result that is not an integer
ALLOWED = "numbers, + - * / // % ** and parentheses"

Number = Fraction | float


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression and returns its value.

    Args:
        expression: The arithmetic to evaluate, e.g. "1234 * 5678" or "(2.5 + 3) / 4". Allowed: numbers, the
            operators + - * / // % ** and parentheses.
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be text, not {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError(f"empty expression; write arithmetic with {ALLOWED}")
    if len(text) > MAX_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"cannot read `{text}` as arithmetic ({getattr(exc, 'msg', exc)}); allowed: {ALLOWED}") \
            from None
    try:
        value = _evaluate(tree.body, text)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError(f"the result is out of range (at most about {MAX_BITS * 3 // 10} digits)") from None
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None
    return _text(value)


_BINARY = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_REFUSED_OPS = {ast.BitXor: "`^` (for a power write **)", ast.BitAnd: "`&`", ast.BitOr: "`|`",
                ast.LShift: "`<<`", ast.RShift: "`>>`", ast.MatMult: "`@`"}


def _evaluate(node: ast.expr, source: str) -> Number:
    if isinstance(node, ast.Constant):
        return _constant(node, source)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand, source)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        if not isinstance(node.op, _BINARY):
            raise ValueError(f"{_REFUSED_OPS.get(type(node.op), 'that operator')} is not allowed; allowed: {ALLOWED}")
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        return _checked(_apply(node.op, left, right))
    raise ValueError(f"`{ast.get_source_segment(source, node) or type(node).__name__}` is not arithmetic; "
                     f"allowed: {ALLOWED}")


def _constant(node: ast.Constant, source: str) -> Number:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{ast.get_source_segment(source, node)}` is not a number; allowed: {ALLOWED}")
    if isinstance(value, int):
        return _checked(Fraction(value))
    if not math.isfinite(value):
        raise OverflowError
    # From its digits, so 0.1 is one tenth; from the float where the digits would make too large a fraction
    # (more digits than a result may have, or an exponent like 1e-999999, not worth computing exactly).
    literal = (ast.get_source_segment(source, node) or "").replace("_", "").lower()
    exponent = literal.partition("e")[2]
    exact = None
    if literal and abs(int(exponent or 0)) <= MAX_BITS:
        try:
            exact = Fraction(literal)
        except ValueError:  # a spelling Fraction does not read: the float is as good
            exact = None
    if exact is None or max(exact.numerator.bit_length(), exact.denominator.bit_length()) > MAX_BITS:
        exact = Fraction(value)
    return _checked(exact)


def _apply(op: ast.operator, left: Number, right: Number) -> Number:
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        return left * right
    if isinstance(op, ast.Div):
        return left / right
    if isinstance(op, ast.FloorDiv):
        return left // right
    if isinstance(op, ast.Mod):
        return left % right
    return _power(left, right)


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(exponent, Fraction) and exponent.denominator == 1 and isinstance(base, Fraction):
        n = abs(exponent.numerator)
        size = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
        grows = base.denominator != 1 or abs(base.numerator) > 1  # 0, 1 and -1 stay small to any power
        if grows and (n > MAX_BITS or (size - 1) * n > MAX_BITS):  # refused before it is computed
            raise OverflowError
        return base ** exponent.numerator
    result = float(base) ** float(exponent)  # a fractional exponent: no exact result in general
    if isinstance(result, complex):
        raise ValueError("a fractional power of a negative number is not a real number")
    return result


def _checked(value: Number | int) -> Number:
    if isinstance(value, int):
        value = Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise OverflowError
        return value
    if max(abs(value.numerator).bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise OverflowError
    return value


def _text(value: Number) -> str:
    if isinstance(value, Fraction) and value.denominator == 1:
        return str(value.numerator)
    number = float(value)
    return "0" if number == 0 else f"{number:.{DIGITS}g}"  # not "-0"; 4 ** 0.5 reads 2, 1 / 3 0.333333333333
