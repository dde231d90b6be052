"""The shared base of tasks that train on question/answer rows: gsm8k, math, dataset (and aime24/amc23 for grading).

Each such task is only its difference from `DatasetTask`: where its rows come from and which column holds the
question (`QUESTION`, `REQUIRED`, `LOCAL_FILES`, `gold`), how a completion's answer is read (`extract`) and how
it is judged (`judge`). The rest is common: splits read once with a seeded validation split carved from train
(tasks/data.py), an optional system prompt, the R1 `format` reward next to `accuracy`, and grades for evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpo.run_config import AgentOptions
from gpo.schema import NonNegative, NonNegativeInt
from gpo.tasks.answers import answer_tag, r1_formatted, weighted_rewards
from gpo.tasks.data import BadRows, DataDir, DataSource, SplitCache, read_rows, resolve
from gpo.types import Example, Grade, Messages, Rewards, passes


@dataclass(frozen=True)
class DatasetTaskConfig(AgentOptions):
    """Options every question/answer task has; a task's own config overrides defaults by redeclaring a field."""

    validation_size: NonNegativeInt = 256  # rows carved from train for checkpoint selection
    split_seed: int = 0
    bad_rows: BadRows = "error"  # what a row without a usable question or answer does
    format_weight: NonNegative = 1.0
    accuracy_weight: NonNegative = 1.0
    system_prompt: str = ""  # empty: no system turn


@dataclass(frozen=True)
class StoredSplitsConfig(DatasetTaskConfig):
    """A built-in benchmark's stored splits: a Hub dataset or local files each, or a local copy of them all."""

    train: DataSource = DataSource()
    test: DataSource = DataSource()
    data_dir: DataDir | None = None  # a local copy DIR laid out as (see LOCAL_FILES); wins when set


class DatasetTask:
    """Rows with a question and a gold answer; rewards `format` (R1 layout) and `accuracy` (the task's judge)."""

    pass_criterion = "accuracy"  # the reward component that says a completion is right (gpo.types.pass_criterion)
    QUESTION = "question"  # the column shown to the model
    REQUIRED: tuple[str, ...] = ("question", "answer")  # columns a row must have, non-empty
    LOCAL_FILES: dict[str, str] = {}  # stored split -> file under data_dir

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self._splits = SplitCache(self._read, cfg.validation_size, cfg.split_seed)

    # --- what a task defines ---------------------------------------------------------------------------------

    def gold(self, row: Example) -> str:
        """The answer to grade against, read from a raw row ('' when the row has none)."""
        raise NotImplementedError

    def extract(self, completion: str) -> str | None:
        """The answer a completion gives (None when it gives none), shown in evaluation records."""
        return answer_tag(completion)

    def judge(self, completions: list[str], examples: list[Example]) -> tuple[list[float], dict[str, float]]:
        """The accuracy score of each completion against its example's `gold` (0 = wrong), and counts to log."""
        raise NotImplementedError

    def weights(self) -> tuple[float, float]:
        return self.cfg.format_weight, self.cfg.accuracy_weight

    def _read(self, split: str) -> list[Example]:
        """A stored split ("train" or "test"), each row given its `gold`."""
        source = resolve(getattr(self.cfg, split), self.cfg.data_dir, self.LOCAL_FILES[split])
        return read_rows(source, required=self.REQUIRED, gold=self.gold, bad_rows=self.cfg.bad_rows)

    # --- the Task interface ----------------------------------------------------------------------------------

    def load(self, split: str) -> Sequence[Example]:
        return self._splits.get(split)

    def prompt(self, example: Example) -> Messages:
        system = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        return [*system, {"role": "user", "content": self.user_message(example)}]

    def user_message(self, example: Example) -> str:
        return str(example[self.QUESTION])

    def reward(self, completions: list[str], examples: list[Example]) -> Rewards:
        fmt = [float(r1_formatted(c)) for c in completions]
        acc, metrics = self.judge(completions, examples)
        return weighted_rewards(fmt, acc, *self.weights(), metrics)

    def grade(self, completions: list[str], examples: list[Example]) -> list[Grade]:
        acc, _ = self.judge(completions, examples)
        return [Grade(extracted=self.extract(c), gold=ex["gold"], correct=passes(a), formatted=r1_formatted(c))
                for c, ex, a in zip(completions, examples, acc, strict=True)]

    def close(self) -> None:
        """Nothing to free unless a task holds workers (math's verifiers)."""
