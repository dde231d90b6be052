"""`dataset`: train and evaluate on your own rows and rewards without writing a task class.

Rows come from `task.path`: a local JSONL, JSON, CSV or Parquet file, a folder of them (split by file name, see
tasks/files.py), or a Hub dataset name (`task.config_name`, `task.train_split` / `task.test_split`); empty, a
built-in sample of sums. The model sees `task.system_prompt` and `task.user_template` filled from the row's
columns (`{question}` is `task.question_field`). A `validation` split is carved from train, seeded, as the
built-in tasks carve theirs (tasks/data.py).

Rewards: a built-in grader (`task.grader`: math, number, exact, choice; tasks/graders.py) gives the components
`format` and `accuracy` (1 right, 0 wrong) as the built-in tasks do, and each of the user's own functions
(`task.rewards`, TRL's calling convention, tasks/user_rewards.py) one component named after it. The total is
their weighted sum. `task.pass_criterion` names the component whose positive value means "right" (gpo.types.passes:
evaluation's accuracy and pass@k, the selectors, DAPO's filter, the success rate); it defaults to `accuracy`.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gpo.errors import UserError, did_you_mean
from gpo.registry import register
from gpo.schema import NonNegativeInt, Positive
from gpo.tasks import files, graders, user_rewards
from gpo.tasks.answers import r1_formatted
from gpo.tasks.base import DatasetTask, DatasetTaskConfig
from gpo.tasks.data import DataSource, SplitCache, read_hub
from gpo.tasks.math import VerifierPool, available_cores, predicted_answer, verify_answers, verify_metrics
from gpo.types import Example, Grade, Rewards, passes

SYSTEM_PROMPT = (
    "You are a helpful assistant. First reason step by step inside <think> </think> tags, then give only the "
    "final answer inside <answer> </answer> tags, and write nothing after the answer. "
    "Layout: <think> your reasoning </think>\n<answer> your answer </answer>"
)
BUILT_IN = ("format", "accuracy")  # the components a grader gives


@dataclass(frozen=True)
class DatasetConfig(DatasetTaskConfig):
    path: str = ""  # a file, a folder, or a Hub dataset name; empty: a built-in sample of 80 sums
    config_name: str | None = None  # a Hub dataset's config
    train_split: str = "train"
    test_split: str = "test"
    question_field: str = "question"
    answer_field: str = "answer"
    user_template: str = "{question}"  # `{column}` placeholders; `{{` and `}}` for literal braces
    grader: Literal["math", "number", "exact", "choice", "none"] = "exact"
    rewards: tuple[str, ...] = ()  # your own reward functions, `module:function` each
    reward_weights: tuple[float, ...] = ()  # one per function in `rewards`; empty = 1.0 each
    pass_criterion: str = ""  # the component that says "right"; empty = accuracy (needs a grader)
    reward_errors: Literal["raise", "zero"] = "raise"  # what a reward function that raises does (gpo/rewards.py)
    # Bound on one call of one of your reward functions: CPU seconds while it computes, wall seconds while it waits
    # (no CPU used for 1 s), and 10x this in wall time whatever it does (tasks/user_rewards.py).
    reward_timeout_s: Positive = 60.0
    reward_format: Literal["standard", "conversational"] = "standard"  # how your functions get completions
    validation_size: NonNegativeInt = 16
    verify_timeout_s: Positive = 5.0  # grader=math: CPU seconds for verifying one completion (tasks/math.py)
    workers: NonNegativeInt = 0  # grader=math: verification processes; 0 = the cores this process may use
    system_prompt: str = SYSTEM_PROMPT

    def __post_init__(self) -> None:
        if self.path and files.is_local(self.path):
            files.check_local(self.path)
        template_fields(self.user_template)
        functions = self.reward_functions()
        names = [r.name for r in functions]
        # an environment's get_reward() is one more component, named after its class (gpo/agent.py)
        environment = [self.environment.replace(":", ".").rpartition(".")[2]] if self.environment else []
        components = [*(BUILT_IN if self.grader != "none" else ()), *names, *environment]
        repeated = sorted({n for n in components if components.count(n) > 1})
        if repeated:
            raise UserError(f"task.rewards: two reward components would be named `{repeated[0]}` (components are "
                            f"named after the function; `format` and `accuracy` are the grader's).")
        if not components:
            raise UserError("task.grader=none and no task.rewards: nothing would reward the model. Pick a grader "
                            f"({', '.join(graders.GRADERS[:-1])}) or give task.rewards=[module:function].")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise UserError(f"task.reward_weights has {len(self.reward_weights)} weights for {len(self.rewards)} "
                            "task.rewards: give one per function, or none (1.0 each).")
        if not all(math.isfinite(w) for w in self.reward_weights):
            raise UserError(f"task.reward_weights must be finite numbers, got {list(self.reward_weights)}.")
        if self.criterion() not in components:
            raise UserError(f"task.pass_criterion `{self.criterion()}` names no reward component; the components "
                            f"are {', '.join(components)}.")
        self._check_columns(functions)

    def reward_functions(self) -> list[user_rewards.RewardFunction]:
        return [user_rewards.load(spec) for spec in self.rewards]

    def criterion(self) -> str:
        return self.pass_criterion or "accuracy"

    def columns_needed(self, functions: Sequence[user_rewards.RewardFunction]) -> dict[str, str]:
        """Each column every row must have, with the setting that asks for it (`{question}` in the template is
        task.question_field's column, whatever its name)."""
        needed = {self.question_field: f"task.question_field={self.question_field}"}
        if self.grader != "none":
            needed.setdefault(self.answer_field, f"task.answer_field={self.answer_field}")
        for field in template_fields(self.user_template):
            needed.setdefault(self.question_field if field == "question" else field,
                              f"task.user_template {self.user_template!r}")
        for function, spec in zip(functions, self.rewards, strict=True):
            for column in sorted(function.columns_needed()):
                needed.setdefault(column, f"task.rewards `{spec}` (its argument `{column}`)")
        return needed

    def _check_columns(self, functions: Sequence[user_rewards.RewardFunction]) -> None:
        """A column the settings name that the files lack fails now, not after the model has loaded: each local
        file's columns are read cheaply (files.columns); a Hub dataset is first read when the run starts."""
        tables: list[tuple[str, list[str] | None]]
        if not self.path:
            tables = [("the built-in sample (task.path is empty)", list(files.sample_rows("train")[0]))]
        elif files.is_local(self.path):
            found = [f for split in (self.train_split, self.test_split)
                     for f in files.split_files(self.path, split, self.train_split, self.test_split)]
            tables = [(f"`{f}`", files.columns(f)) for f in dict.fromkeys(found)]
        else:
            return
        needed = self.columns_needed(functions)
        for where, have in tables:
            if have is None:  # an empty file, or a JSON array too large to read ahead: checked as rows load
                continue
            listed = ", ".join(have) or "none"
            for column, setting in needed.items():
                if column not in have:
                    fix = (" Set task.question_field and task.answer_field to the columns that hold the question "
                           "and its answer." if setting in ("task.question_field=question", "task.answer_field=answer")
                           else "")
                    raise UserError(f"{setting}: {where} has no column `{column}` (its columns: {listed})."
                                    f"{did_you_mean(column, have)}{fix}")
            if "gold" in have and self.answer_field != "gold":
                raise UserError(f"{where} has a column `gold`, which holds the graded answer here (from "
                                f"task.answer_field={self.answer_field}): rename it.")


def template_fields(template: str) -> list[str]:
    """The columns a user template names; a malformed one (an unmatched brace, `{}`) is refused."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise UserError(f"task.user_template {template!r}: {exc} (write `{{{{` and `}}}}` for literal "
                        "braces).") from None
    # A column's name may hold spaces or capitals; `{0}`, `{a.b}` and `{a[0]}` would index or read attributes.
    bad = [f for f in fields if not f.strip() or f.isdigit() or any(c in f for c in ".[]")]
    if bad:
        raise UserError(f"task.user_template {template!r}: `{{{bad[0]}}}` is not a column name; placeholders are "
                        "`{question}` and `{COLUMN}` for any other column.")
    return fields


@register("task", "dataset", config=DatasetConfig)
class Dataset(DatasetTask):
    """Your own rows (JSONL/JSON/CSV/Parquet/Hub) with a built-in grader and/or your own TRL-style rewards."""

    def __init__(self, cfg: DatasetConfig) -> None:
        self.cfg = cfg
        self.QUESTION = cfg.question_field
        self.pass_criterion = cfg.criterion()
        self.reward_errors = cfg.reward_errors
        self._functions = cfg.reward_functions()
        self._weights = list(cfg.reward_weights) or [1.0] * len(self._functions)
        self._template = template_fields(cfg.user_template)
        self._columns: set[str] = set()  # every column a loaded row has: what the reward functions are given
        self._pool: VerifierPool | None = None
        self._splits = SplitCache(self._read, cfg.validation_size, cfg.split_seed)

    # --- rows ------------------------------------------------------------------------------------------------

    def _read(self, split: str) -> list[Example]:
        cfg = self.cfg
        name = cfg.train_split if split == "train" else cfg.test_split
        if not cfg.path:
            parts = [("the built-in sample", files.sample_rows(split))]
        elif files.is_local(cfg.path):
            found = files.split_files(cfg.path, name, cfg.train_split, cfg.test_split)
            if not found:
                raise UserError(f"task.path `{cfg.path}` has no `{name}` split: a single file is the train split "
                                f"only; put {cfg.train_split}.jsonl and {cfg.test_split}.jsonl (or .json/.csv/"
                                ".parquet) in a folder and point task.path at it.")
            parts = [(str(f), files.read_table(f)) for f in found]
        else:
            hub = DataSource(cfg.path, cfg.config_name, name)
            offline = "Save it as files and set task.path to the file or folder."
            parts = [(f"Hub dataset `{cfg.path}` split `{name}`", read_hub(hub, offline))]
        rows = [row for where, part in parts for row in self._checked(part, where)]
        if not rows:
            raise UserError(f"task.path `{cfg.path}`: the `{name}` split has no usable rows; nothing to "
                            f"{'train' if split == 'train' else 'evaluate'} on.")
        return rows

    def _checked(self, rows: list[Example], where: str) -> list[Example]:
        cfg, kept = self.cfg, []
        needed = cfg.columns_needed(self._functions)
        for number, row in enumerate(rows, start=1):
            problem = next((f"is missing column `{c}`" for c in needed if c not in row), None)
            if problem is None and _blank(row.get(cfg.question_field)):
                problem = f"has an empty `{cfg.question_field}`"
            gold = "" if problem else self._gold(row)
            if problem is None and cfg.grader != "none" and not gold:
                problem = (f"has an empty `{cfg.answer_field}`" if _blank(row.get(cfg.answer_field)) else
                           f"has a `{cfg.answer_field}` that {graders.gold_problem(cfg.grader)} "
                           f"({str(row.get(cfg.answer_field))[:80]!r})")
            if problem is None and "gold" in row and cfg.answer_field != "gold":
                problem = "has a column `gold`, which holds the graded answer here: rename it"
            if problem is None:
                kept.append({**row, "gold": gold})
                self._columns |= set(row)
            elif cfg.bad_rows == "error":
                raise UserError(f"{where}: row {number} {problem} (columns: {', '.join(map(str, row))}). Fix the "
                                "row, or set `task.bad_rows=skip` to leave such rows out.")
        return kept

    def _gold(self, row: Example) -> str:
        value = row.get(self.cfg.answer_field)
        text = "" if value is None else str(value)
        return graders.gold_text(self.cfg.grader, text) if self.cfg.grader != "none" else text

    # --- prompts, rewards, grades ----------------------------------------------------------------------------

    def user_message(self, example: Example) -> str:
        values = {c: example.get(c, "") for c in self._template}
        values["question"] = example[self.cfg.question_field] if "question" in self._template else ""
        return self.cfg.user_template.format_map(values)

    def extract(self, completion: str) -> str | None:
        return predicted_answer(completion)

    def judge(self, completions: list[str], examples: list[Example]) -> tuple[list[float], dict[str, float]]:
        predictions = [predicted_answer(c) for c in completions]
        golds = [ex["gold"] for ex in examples]
        if self.cfg.grader != "math":
            right = [graders.correct(self.cfg.grader, p, g) for p, g in zip(predictions, golds, strict=True)]
            return [float(r) for r in right], {}
        if self._pool is None and any(p is not None for p in predictions):
            self._pool = VerifierPool(self.cfg.workers or available_cores(), self.cfg.verify_timeout_s)
        verdicts = verify_answers(self._pool, golds, predictions)
        return [float(correct) for _, correct in verdicts], verify_metrics(verdicts)

    def reward(self, completions: list[str], examples: list[Example], completion_ids: list[list[int]] | None = None,
               trajectories: list[list[dict]] | None = None, environments: list[Any] | None = None) -> Rewards:
        if self.cfg.grader != "none":
            rewards = super().reward(completions, examples)
        else:
            rewards = Rewards(total=[0.0] * len(completions), components={}, metrics={})
        for function, weight in zip(self._functions, self._weights, strict=True):
            values = self._call(function, completions, examples, completion_ids, trajectories, environments)
            scores = [0.0 if v is None else v for v in values]
            rewards.components[function.name] = scores
            rewards.total = [t + weight * s for t, s in zip(rewards.total, scores, strict=True)]
            rewards.metrics[f"{function.name}_none"] = float(sum(v is None for v in values))
        return rewards

    def grade(self, completions: list[str], examples: list[Example]) -> list[Grade]:
        if self.pass_criterion == "accuracy":
            return super().grade(completions, examples)
        function = next(f for f in self._functions if f.name == self.pass_criterion)
        values = self._call(function, completions, examples, None)
        return [Grade(extracted=self.extract(c), gold=str(ex["gold"]), correct=v is not None and passes(v),
                      formatted=r1_formatted(c))
                for c, ex, v in zip(completions, examples, values, strict=True)]

    def load(self, split: str) -> Sequence[Example]:
        return self._splits.get(split)

    def close(self) -> None:
        """Stop math-verify's workers (grader=math); safe to call twice, a later reward starts them again."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def _call(self, function: user_rewards.RewardFunction, completions: list[str], examples: list[Example],
              completion_ids: list[list[int]] | None, trajectories: list[list[dict]] | None = None,
              environments: list[Any] | None = None) -> list[float | None]:
        """`completions` are texts (a trajectory's last model turn); conversational functions get each
        trajectory's turns where there are some, as TRL passes a multi-turn completion."""
        messages = [self.prompt(ex) for ex in examples]
        if self.cfg.reward_format == "conversational":
            prompts: list = messages
            shown: list = trajectories or [[{"role": "assistant", "content": c}] for c in completions]
        else:
            prompts, shown = [m[-1]["content"] for m in messages], list(completions)
        columns = {c: [ex.get(c) for ex in examples] for c in sorted(self._columns)}
        try:
            return user_rewards.call(function, self.cfg.reward_timeout_s, prompts, shown, completion_ids, columns,
                                     environments)
        except user_rewards.RewardFunctionError as exc:
            if "did not return within" in str(exc) and self.reward_errors == "raise":
                # Stop now: re-scoring the batch one completion at a time to name the culprit would wait this long
                # again for each completion.
                shown_one = completions[0][:200]
                raise UserError(f"task `dataset`: {exc} (the first: {shown_one!r}). Make it faster, raise task."
                                "reward_timeout_s, or set task.reward_errors=zero to score such calls 0.") from None
            raise


def _blank(value: object) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())
