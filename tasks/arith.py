"""`arith`: procedurally generated arithmetic word problems with exact integer answers; the embedded default.

Not from a paper: it exists so `gpo run` trains something real offline in minutes on a CPU. It keeps the reward
structure of the CPPO paper's tasks (arXiv 2503.22342: format + accuracy), but is lenient where GSM8K is strict,
because a 135M model must get a learning signal: the answer is read from an `<answer>` tag or, failing that,
from the last number in the completion, and the format (an answer tag) carries a small weight. With one-digit
operands SmolLM2-135M-Instruct at T=1 is right often enough that most groups of 8 are mixed;
the plain question style ("What is 3 + 5?") is the default because at T=1 the model does about three times better on it
than on the same sum told as a story (configs/task/arith.yaml has the figures).

Each split is generated from its own seed stream (train, validation and test never share a generator seed).
One-digit additions have only 100 distinct questions, so the splits overlap (in the story style they share sums
but not wordings); raise `digits` or `operations` for a held-out test of skill rather than of recall.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gpo.errors import UserError
from gpo.registry import register
from gpo.run_config import AgentOptions
from gpo.schema import NonNegative, PositiveInt
from gpo.tasks.answers import answer_tag, last_number, same_number, weighted_rewards
from gpo.tasks.data import SPLITS
from gpo.types import Example, Grade, Messages, Rewards

SYSTEM_PROMPT = (
    "You are a helpful assistant. Solve the arithmetic problem and give the final number inside "
    "<answer> </answer> tags, for example <answer> 7 </answer>."
)
NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Isla", "Jack", "Kai", "Lena", "Mia", "Noah")
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards", "cookies", "stamps")
# How each operator reads in words; the question also shows the expression so small models can latch onto it.
PHRASES = {
    "+": "{name} gets {n} more",
    "-": "{name} gives away {n}",
    "*": "{name}'s pile is multiplied by {n}",
}
SPLIT_STREAM = {"train": 0, "validation": 1, "test": 2}  # disjoint generator seeds per split


@dataclass(frozen=True)
class ArithConfig(AgentOptions):
    digits: PositiveInt = 1  # operands have this many digits (1: 0-9)
    operations: PositiveInt = 1  # operators per problem (1: "a + b")
    operators: tuple[Literal["+", "-", "*"], ...] = ("+",)  # drawn uniformly from these
    allow_negative: bool = False  # if False, a subtraction never takes the running total below zero
    # question: "What is 3 + 5?"; story: a word problem around the same expression
    style: Literal["question", "story"] = "question"
    seed: int = 0
    # a finite pool, cycled in seeded epochs: e.g. 64 so history-based selectors see repeats
    train_size: PositiveInt = 10000
    validation_size: PositiveInt = 256
    test_size: PositiveInt = 500
    format_weight: NonNegative = 0.1  # small: strict answer tags alone give a 135M model almost no signal
    accuracy_weight: NonNegative = 1.0
    system_prompt: str = SYSTEM_PROMPT


def make_problem(rng: random.Random, digits: int, operations: int, operators: Sequence[str],
                 allow_negative: bool, style: str = "question") -> Example:
    """One word problem and its exact answer, evaluated left to right (the order the story tells it)."""
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(low, high)
    expression, story = str(total), [f"{name} has {total} {item}."]
    for _ in range(operations):
        op = rng.choice(list(operators))
        floor = op == "-" and not allow_negative  # keep the running total >= 0
        n = rng.randint(min(low, total), min(high, total)) if floor else rng.randint(low, high)
        total = total + n if op == "+" else total - n if op == "-" else total * n
        expression = f"({expression}) {op} {n}" if op == "*" and " " in expression else f"{expression} {op} {n}"
        story.append(PHRASES[op].format(name=name, n=n) + ".")
    if style == "story":
        question = " ".join(story) + f" How many {item} does {name} have now? ({expression} = ?)"
    else:
        question = f"What is {expression}?"
    return {"question": question, "expression": expression, "gold": str(total)}


def predicted_answer(completion: str) -> str | None:
    """The number in the `<answer>` tag, else the completion's last number (lenient on purpose, see module doc)."""
    tag = answer_tag(completion)
    if tag is not None and last_number(tag) is not None:
        return last_number(tag)
    return last_number(completion)


@register("task", "arith", config=ArithConfig)
class Arith:
    """Seeded arithmetic word problems (no download): lenient accuracy + a lightly weighted answer tag."""

    pass_criterion = "accuracy"  # the reward component that says a completion is right (gpo.types.pass_criterion)

    def __init__(self, cfg: ArithConfig) -> None:
        if not cfg.operators:  # each operator is checked by its annotation; an empty tuple gives nothing to draw
            raise UserError(f"task.operators must name at least one of {', '.join(PHRASES)}, got none.")
        self.cfg = cfg
        self._splits: dict[str, list[Example]] = {}

    def load(self, split: str) -> Sequence[Example]:
        if split not in SPLITS:
            raise UserError(f"unknown split `{split}`; splits are {', '.join(SPLITS)}.")
        if split not in self._splits:
            size = getattr(self.cfg, f"{split}_size")
            # A string seed hashes deterministically (random.seed version 2), so splits are stable across runs.
            rng = random.Random(f"arith-{self.cfg.seed}-{SPLIT_STREAM[split]}")
            self._splits[split] = [
                make_problem(rng, self.cfg.digits, self.cfg.operations, self.cfg.operators, self.cfg.allow_negative,
                             self.cfg.style)
                for _ in range(size)
            ]
        return self._splits[split]

    def prompt(self, example: Example) -> Messages:
        return [{"role": "system", "content": self.cfg.system_prompt}, {"role": "user", "content": example["question"]}]

    def reward(self, completions: list[str], examples: list[Example]) -> Rewards:
        fmt = [float(answer_tag(c) is not None) for c in completions]
        acc = [float(g.correct) for g in self.grade(completions, examples)]
        return weighted_rewards(fmt, acc, self.cfg.format_weight, self.cfg.accuracy_weight)

    def grade(self, completions: list[str], examples: list[Example]) -> list[Grade]:
        grades = []
        for completion, example in zip(completions, examples, strict=True):
            extracted = predicted_answer(completion)
            grades.append(Grade(extracted=extracted, gold=example["gold"],
                                correct=extracted is not None and same_number(extracted, example["gold"]),
                                formatted=answer_tag(completion) is not None))
        return grades

    def close(self) -> None:
        """Nothing to free: the problems are generated in this process."""
