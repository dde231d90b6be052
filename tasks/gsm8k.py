"""`gsm8k`: grade-school maths word problems (Cobbe et al. 2021, arXiv 2110.14168), as CPPO trains on them.

Rewards follow the CPPO paper's open-r1 recipe (arXiv 2503.22342; reference section 3): an R1-style format
reward (1 for `<think>...</think>` then `<answer>...</answer>`) plus accuracy (2 for the exact answer, 1.5 for a
numerically equal one), weighted 1:1. Changed relative to the reference (its section 8.10): text after
`</answer>` fails the format, negative answers are read with their sign, and `$` / thousands commas are ignored.
Evaluation grades with the same rule as training (the reference graded with a laxer last-number match).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpo.registry import register
from gpo.schema import NonNegative, NonNegativeInt
from gpo.tasks.answers import answer_tag, clean_number_text, numbers, r1_formatted, same_number, weighted_rewards
from gpo.tasks.data import BadRows, DataDir, DataSource, SplitCache, read_rows, resolve
from gpo.types import Example, Grade, Messages, Rewards

SYSTEM_PROMPT = (
    "You are a helpful assistant that solves grade-school maths problems. First reason about the problem "
    "step by step inside <think> </think> tags, then give only the final number inside <answer> </answer> "
    "tags, and write nothing after the answer. Layout: <think> your reasoning </think>\n<answer> 42 </answer>"
)
EXACT, NUMERIC = 2.0, 1.5  # the paper's accuracy values


@dataclass(frozen=True)
class GSM8KConfig:
    train: DataSource = DataSource("openai/gsm8k", "main", "train")
    test: DataSource = DataSource("openai/gsm8k", "main", "test")
    data_dir: DataDir | None = None  # a local copy laid out like ../shared/data (gsm8k/train.jsonl); wins when set
    validation_size: NonNegativeInt = 256  # rows carved from train for checkpoint selection
    split_seed: int = 0
    bad_rows: BadRows = "error"  # what a row without a usable question or answer does
    format_weight: NonNegative = 1.0
    accuracy_weight: NonNegative = 1.0
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
class GSM8K:
    """GSM8K word problems: R1 format reward + exact/numeric answer accuracy (the CPPO paper's setup)."""

    LOCAL_FILES = {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"}

    def __init__(self, cfg: GSM8KConfig) -> None:
        self.cfg = cfg
        self._splits = SplitCache(self._read, cfg.validation_size, cfg.split_seed)

    def _read(self, split: str) -> list[Example]:
        source = resolve(getattr(self.cfg, split), self.cfg.data_dir, self.LOCAL_FILES[split])
        return read_rows(source, required=("question", "answer"), gold=lambda row: gold_answer(row["answer"]),
                         bad_rows=self.cfg.bad_rows)

    def load(self, split: str) -> Sequence[Example]:
        return self._splits.get(split)

    def prompt(self, example: Example) -> Messages:
        return [{"role": "system", "content": self.cfg.system_prompt}, {"role": "user", "content": example["question"]}]

    def reward(self, completions: list[str], examples: list[Example]) -> Rewards:
        fmt = [float(r1_formatted(c)) for c in completions]
        acc = [accuracy(answer_tag(c), ex["gold"]) for c, ex in zip(completions, examples, strict=True)]
        return weighted_rewards(fmt, acc, self.cfg.format_weight, self.cfg.accuracy_weight)

    def grade(self, completions: list[str], examples: list[Example]) -> list[Grade]:
        return [
            Grade(extracted=answer_tag(c), gold=ex["gold"], correct=accuracy(answer_tag(c), ex["gold"]) > 0,
                  formatted=r1_formatted(c))
            for c, ex in zip(completions, examples, strict=True)
        ]

    def close(self) -> None:
        """Nothing to free: grading runs in this process."""
