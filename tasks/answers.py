"""Reading answers out of model completions and weighing the judgements into rewards, shared by every task.

Everything here is pure and linear in the completion's length: a policy can emit 100 KB of braces or tags,
and the reward must still come back in bounded time (no regex that can backtrack quadratically).

Fixes relative to the reward helpers of the CPPO paper's released code (arXiv 2503.22342):
  * the R1 format check no longer lets text after `</answer>` pass (the reference's MULTILINE `$` did),
    and it accepts any whitespace between the blocks instead of exactly one newline;
  * numbers keep their minus sign, and `$`, thousands commas and a trailing full stop are dropped first.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from gpo.types import Rewards

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

# A signed decimal: "-3", "12.5", ".5". Thousands commas are removed before matching (see `clean_number_text`).
NUMBER_RE = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)")
# Each tag exactly once, in order, nothing but whitespace around the blocks. Counts are checked first, so the
# lazy groups below cannot scan past a second tag: the match is linear.
_R1_RE = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def r1_formatted(text: str) -> bool:
    """`<think>...</think>` then `<answer>...</answer>`, each once, non-empty answer, and nothing after it."""
    if any(text.count(tag) != 1 for tag in (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)):
        return False
    match = _R1_RE.fullmatch(text)
    return match is not None and match.group(2).strip() != ""


def answer_tag(text: str) -> str | None:
    """Stripped content of the last closed `<answer>...</answer>`; None when there is none (e.g. truncated)."""
    end = text.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = text.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return text[start + len(ANSWER_OPEN):end].strip()


def last_boxed(text: str) -> str | None:
    """Content of the last balanced `\\boxed{...}` (or `\\fbox{...}`); None when there is none or it never closes."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    while start >= 0:
        i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
        while i < len(text) and text[i] in " \t\n":  # `\boxed {x}` is fine; `\boxed 5` has no braced argument
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j].strip()
            return None  # unbalanced: the completion was cut off inside the box
        start = max(text.rfind("\\boxed", 0, start), text.rfind("\\fbox", 0, start))
    return None


def clean_number_text(text: str) -> str:
    """Drop what GSM8K-style answers decorate numbers with: `$`, thousands commas, a final `.`, unicode minus."""
    text = text.strip().replace("\u2212", "-").replace("$", "")
    text = _THOUSANDS_RE.sub("", text)
    return text.strip().rstrip(".").strip()


def numbers(text: str) -> list[str]:
    """Every signed number in `text`, in order, after `clean_number_text`."""
    return NUMBER_RE.findall(clean_number_text(text))


def last_number(text: str) -> str | None:
    found = numbers(text)
    return found[-1] if found else None


def as_decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text)
    except (InvalidOperation, ValueError):
        return None


def same_number(a: str, b: str) -> bool:
    """Numerically equal decimals ("18.00" and "18"); False when either is not a number."""
    x, y = as_decimal(a), as_decimal(b)
    return x is not None and y is not None and x == y


def weighted_rewards(fmt: list[float], acc: list[float], format_weight: float, accuracy_weight: float,
                     metrics: dict[str, float] | None = None) -> Rewards:
    """The `format` and `accuracy` components and their weighted sum, the total the objective sees."""
    total = [format_weight * f + accuracy_weight * a for f, a in zip(fmt, acc, strict=True)]
    return Rewards(total=total, components={"format": fmt, "accuracy": acc}, metrics=metrics or {})
