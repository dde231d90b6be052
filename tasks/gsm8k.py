"""`gsm8k`: grade-school maths word problems (Cobbe et al. 2021, arXiv 2110.14168), as CPPO trains on them.

Rewards follow the CPPO paper's open-r1 recipe (arXiv 2503.22342): an R1-style format
reward (1 for `<think>...</think>` then `<answer>...</answer>`) plus accuracy (2 for the exact answer, 1.5 for a
numerically equal one), weighted 1:1. Changed relative to the reference (its section 8.10): text after
`</answer>` fails the format, negative answers are read with their sign, and `$` / thousands commas are ignored.
Evaluation grades with the same rule as training (the reference graded with a laxer last-number match).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpo.registry import register
from gpo.tasks.answers import answer_tag, clean_number_text, numbers, same_number
from gpo.tasks.base import DatasetTask, StoredSplitsConfig
from gpo.tasks.data import DataSource
from gpo.types import Example

SYSTEM_PROMPT = (
    "You are a helpful assistant that solves grade-school maths problems. First reason about the problem "
    "step by step inside <think> </think> tags, then give only the final number inside <answer> </answer> "
    "tags, and write nothing after the answer. Layout: <think> your reasoning </think>\n<answer> 42 </answer>"
)
EXACT, NUMERIC = 2.0, 1.5  # the paper's accuracy values


@dataclass(frozen=True)
class GSM8KConfig(StoredSplitsConfig):
    train: DataSource = DataSource("openai/gsm8k", "main", "train")
    test: DataSource = DataSource("openai/gsm8k", "main", "test")
    system_prompt: str = SYSTEM_PROMPT


def gold_answer(solution: str) -> str:
    """The text after `####` in a GSM8K worked solution, cleaned like a prediction."""
    marker = solution.rfind("####")
    return clean_number_text(solution[marker + 4:]) if marker >= 0 else ""


def accuracy(prediction: str | None, gold: str) -> float:
    """2 exact, 1.5 when the prediction holds exactly one number equal to the gold, else 0."""
    if prediction is None:
        return 0.0
    cleaned = clean_number_text(prediction)
    if cleaned == gold:
        return EXACT
    found = numbers(cleaned)
    return NUMERIC if len(found) == 1 and same_number(found[0], gold) else 0.0


@register("task", "gsm8k", config=GSM8KConfig)
class GSM8K(DatasetTask):
    """GSM8K word problems: R1 format reward + exact/numeric answer accuracy (the CPPO paper's setup)."""

    LOCAL_FILES = {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"}

    def gold(self, row: Example) -> str:
        return gold_answer(row["answer"])

    def judge(self, completions: list[str], examples: list[Example]) -> tuple[list[float], dict[str, float]]:
        return [accuracy(answer_tag(c), ex["gold"]) for c, ex in zip(completions, examples, strict=True)], {}
