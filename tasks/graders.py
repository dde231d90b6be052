"""The built-in graders of `task=dataset` (`task.grader`): how a gold answer is read and a prediction judged.

Every grader judges the answer `predicted_answer` reads from a completion (tasks/math.py: the last `\\boxed{}`
inside `<answer>`, else the tag's content, else the completion's last `\\boxed{}`), the extraction the built-in
tasks use. `math` is verified by math-verify in worker processes (tasks/math.py); the others are pure functions
here. A gold a grader cannot read is refused when the rows load, not scored 0 for a whole run.
"""

from __future__ import annotations

import re

from gpo.tasks.answers import clean_number_text, last_boxed, numbers, same_number

GRADERS = ("math", "number", "exact", "choice", "none")  # none: only the user's own reward functions
LETTERS = "ABCDEFGHIJ"

_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}")
# A letter alone, or followed by `)`, `.`, `:` or a space and the option's text: "B", "(B)", "B) 12", "B. twelve".
_CHOICE_RE = re.compile(r"\(?([A-J])(?:\)|\.|:|\s|$)")


def gold_text(grader: str, answer: str) -> str:
    """The gold `grader` compares against, read from the answer column ('' when it holds none it can use)."""
    answer = answer.strip()
    if grader == "number":
        marker = answer.rfind("####")  # a GSM8K-style worked solution ends in `#### 72`
        found = numbers(answer[marker + 4:] if marker >= 0 else answer)
        return found[0] if len(found) == 1 else ""
    if grader == "choice":
        return choice_letter(answer) or ""
    if grader == "math":
        return last_boxed(answer) or answer
    return answer


def gold_problem(grader: str) -> str:
    """Why a row's answer is unusable for `grader`, for the load-time error."""
    return {"number": "does not hold exactly one number", "choice": f"is not a letter {LETTERS[0]}-{LETTERS[-1]}",
            }.get(grader, "is empty")


def correct(grader: str, prediction: str | None, gold: str) -> bool:
    """`prediction` judged against `gold` by one of the pure graders (number, exact, choice)."""
    if prediction is None:
        return False
    if grader == "number":
        found = numbers(clean_number_text(prediction))
        return len(found) == 1 and same_number(found[0], gold)
    if grader == "exact":
        return normalised(prediction) == normalised(gold)
    if grader == "choice":
        return choice_letter(prediction) == gold
    raise ValueError(f"grader {grader!r} is not a pure grader")


def normalised(text: str) -> str:
    """Case, spacing, `$`, `\\text{}` and a final full stop do not matter: "The  Nile." = "the nile"."""
    text = _TEXT_RE.sub(r"\1", text.replace("$", ""))
    return " ".join(text.casefold().split()).rstrip(".").strip()


def choice_letter(text: str) -> str | None:
    """The option letter an answer gives ("B", "(B)", "B) 12", "\\text{B}"), None when it gives none."""
    match = _CHOICE_RE.match(_TEXT_RE.sub(r"\1", text).strip())
    return match.group(1) if match else None
