"""Competition sets with whole-number answers, for evaluation only: AIME 2024 (`aime24`) and AMC 2023 (`amc23`),
the CPPO paper's out-of-distribution sets (arXiv 2503.22342). Thirty and forty problems are a test, never a
training set: `load("train")` and `load("validation")` are user errors that point at `eval.tasks`.

Prompting and answer extraction follow the `math` task (an R1 layout with the final answer in \\boxed{} inside
<answer>), so a policy trained on MATH is scored as it was trained. Every gold is an integer; a prediction is
correct when it holds exactly one number and that number equals the gold, so AIME's zero-padded "025" and a
predicted "25" or "25.0" agree; no symbolic verifier is needed (or run) for whole numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpo.errors import UserError
from gpo.run_config import AgentOptions
from gpo.tasks.answers import as_decimal, numbers
from gpo.tasks.base import DatasetTask
from gpo.tasks.data import BadRows, DataDir, DataSource, read_rows, resolve
from gpo.tasks.math import CORRECT, SYSTEM_PROMPT, predicted_answer
from gpo.types import Example

__all__ = ["CompetitionConfig", "CompetitionSet", "SYSTEM_PROMPT"]


def same_integer(prediction: str | None, gold: str) -> bool:
    """True when `prediction` holds exactly one number and it equals the integer `gold` ("025" = 25 = 25.0)."""
    if prediction is None:
        return False
    found = numbers(prediction.replace("{,}", "").replace("\\!", ""))  # LaTeX thousands separators
    if len(found) != 1:
        return False
    a, b = as_decimal(found[0]), as_decimal(gold.strip())
    return a is not None and b is not None and a == b


def gold_answer(row: Example) -> str:
    return str(row.get("answer") if row.get("answer") is not None else "").strip()


@dataclass(frozen=True)
class CompetitionConfig(AgentOptions):
    """What aime24 and amc23 take; each config only names its own Hub dataset as the `test` default."""

    test: DataSource = DataSource()
    data_dir: DataDir | None = None  # a local copy DIR laid out as (LOCAL_FILE under it); wins when set
    bad_rows: BadRows = "error"
    system_prompt: str = SYSTEM_PROMPT


class CompetitionSet(DatasetTask):
    """The shared behaviour of `aime24` and `amc23`; each subclass names its file and its Hub dataset."""

    NAME = ""
    LOCAL_FILE = ""  # under task.data_dir (or $GPO_DATA_DIR), DIR laid out as
    QUESTION = "problem"
    REQUIRED = ("problem", "answer")

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self._test: list[Example] | None = None

    def gold(self, row: Example) -> str:
        return gold_answer(row)

    def extract(self, completion: str) -> str | None:
        return predicted_answer(completion)

    def judge(self, completions: list[str], examples: list[Example]) -> tuple[list[float], dict[str, float]]:
        pairs = zip(completions, examples, strict=True)
        return [CORRECT if same_integer(predicted_answer(c), ex["gold"]) else 0.0 for c, ex in pairs], {}

    def weights(self) -> tuple[float, float]:
        return 1.0, 1.0  # the math task's scale, for completeness: these sets are not trained on

    def load(self, split: str) -> Sequence[Example]:
        if split != "test":
            raise UserError(
                f"`{self.NAME}` is an evaluation-only set (test split only): train on another task and score "
                f"this one with `eval.tasks=[{self.NAME}]`, or run `gpo eval task={self.NAME}`.")
        if self._test is None:
            source = resolve(self.cfg.test, self.cfg.data_dir, self.LOCAL_FILE)
            rows = read_rows(source, required=self.REQUIRED, gold=self.gold, bad_rows=self.cfg.bad_rows)
            bad = [r["gold"] for r in rows if as_decimal(r["gold"]) is None]
            if bad:
                raise UserError(f"`{self.NAME}` answers must be whole numbers, got {bad[:5]} in {source.path}.")
            self._test = rows
        return self._test
