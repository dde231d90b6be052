"""Where a task's rows come from: a Hugging Face Hub dataset, or local JSONL / parquet files.

A task names one `DataSource` per stored split (train, test); the validation split is carved out of train here,
seeded and disjoint from the train rows the task then serves, so checkpoints are never selected on test (the
CPPO reference selected its best checkpoint on the test set, arXiv 2503.22342). A bad row fails loudly with
its file and row number instead of turning into a silent zero reward halfway through a run.
"""

from __future__ import annotations

import glob
import json
import os
import random
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gpo.errors import UserError
from gpo.schema import ExistingDir
from gpo.types import Example

LOCAL_SUFFIXES = (".jsonl", ".parquet")  # other existing local files are read as JSON lines
SPLITS = ("train", "validation", "test")
DATA_DIR_ENV = "GPO_DATA_DIR"

# What a row without a usable question or answer does: fail naming it, or be left out with a warning.
BadRows = Literal["error", "skip"]
# A task's `data_dir`: a local copy DIR laid out as the task expects; one that does not exist fails at compose time.
DataDir = ExistingDir


@dataclass(frozen=True)
class DataSource:
    """A Hub dataset (`path` = its name, `name` = its config, `split`) or local files (`path` ends in .jsonl or
    .parquet; a glob reads several files in sorted order)."""

    path: str = ""
    name: str | None = None  # Hub config, e.g. `main` for openai/gsm8k; ignored for local files
    split: str = "train"  # Hub split; ignored for local files


def check_options(validation_size: int, bad_rows: str) -> None:
    """Checks of the data options for callers that bypass the composer (`read_rows`, `carve_validation`); a
    composed task config has them checked by its annotations (NonNegativeInt, BadRows)."""
    if validation_size < 0:
        raise UserError(f"task.validation_size must be >= 0, got {validation_size}.")
    if bad_rows not in ("error", "skip"):
        raise UserError(f"task.bad_rows must be `error` or `skip`, got `{bad_rows}`.")


def as_source(value: DataSource | dict[str, Any]) -> DataSource:
    """A DataSource, or a plain mapping of its fields (a task config constructed by hand with a dict, as
    `registry.Entry.build` used to pass them; a composed config already holds DataSources)."""
    return value if isinstance(value, DataSource) else DataSource(**dict(value))


def resolve(source: DataSource | dict[str, Any], data_dir: str | None, local_file: str) -> DataSource:
    """Where a split is read from: `data_dir/local_file` when the task's `data_dir` is set (a local copy laid
    out as the tasks expect: gsm8k/test.jsonl, ...), else `source`; a Hub `source` is replaced by
    `$GPO_DATA_DIR/local_file` when that variable is set (machines without Hub access set it once)."""
    source = as_source(source)
    data_dir = data_dir or (None if is_local(source.path) else os.environ.get(DATA_DIR_ENV))
    return DataSource(str(Path(data_dir).expanduser() / local_file)) if data_dir else source


def is_local(path: str) -> bool:
    return path.endswith(LOCAL_SUFFIXES) or Path(path).expanduser().exists()


def read_rows(source: DataSource, required: Sequence[str], gold: Callable[[Example], str],
              bad_rows: str = "error") -> list[Example]:
    """All rows of `source`, each given `row["gold"] = gold(row)`.

    A row missing a `required` column, or whose gold comes out empty, raises a UserError naming the file and
    row number; with `bad_rows="skip"` it is left out with a warning instead.
    """
    check_options(0, bad_rows)
    if not source.path:
        raise UserError("data source has an empty `path`: give a Hub dataset name or a .jsonl/.parquet file.")
    if is_local(source.path):
        parts = [(str(file), read_local(file)) for file in _local_files(source.path)]
    else:
        config = f" ({source.name})" if source.name else ""
        where = f"Hub dataset `{source.path}`{config} split `{source.split}`"
        parts = [(where, read_hub(source))]
    rows: list[Example] = []
    for where, part in parts:
        rows += _checked(part, required, gold, where, skip=bad_rows == "skip")
    return rows


def carve_validation(rows: Sequence[Example], size: int, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, validation): `size` rows drawn with `seed` become validation; train keeps the rest, in order."""
    if size < 0:
        raise UserError(f"validation_size must be >= 0, got {size}.")
    if size >= len(rows):
        raise UserError(f"validation_size {size} leaves no training rows (the train split has {len(rows)}).")
    held_out = set(random.Random(seed).sample(range(len(rows)), size))
    train = [r for i, r in enumerate(rows) if i not in held_out]
    validation = [rows[i] for i in sorted(held_out)]
    return train, validation


class SplitCache:
    """A task's three splits, read once on first use: `validation` is carved from `train` (see module doc)."""

    def __init__(self, read: Callable[[str], list[Example]], validation_size: int, seed: int) -> None:
        self._read = read  # stored split name ("train" | "test") -> rows
        self._validation_size = validation_size
        self._seed = seed
        self._splits: dict[str, list[Example]] = {}

    def get(self, split: str) -> list[Example]:
        if split not in SPLITS:
            raise UserError(f"unknown split `{split}`; splits are {', '.join(SPLITS)}.")
        if split not in self._splits:
            if split == "test":
                self._splits["test"] = self._read("test")
            else:
                train, validation = carve_validation(self._read("train"), self._validation_size, self._seed)
                self._splits.update(train=train, validation=validation)
        return self._splits[split]


def _local_files(pattern: str) -> list[Path]:
    expanded = str(Path(pattern).expanduser())
    files = sorted(Path(p) for p in glob.glob(expanded)) if glob.has_magic(expanded) else [Path(expanded)]
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise UserError(f"data file `{missing[0] if missing else pattern}` does not exist.")
    return files


def read_local(file: Path) -> list[Example]:
    """Every row of a JSON-lines or Parquet file, as dicts; a row that is not an object fails naming it."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq  # comes with `datasets`; imported only when a parquet file is read

        try:
            return pq.read_table(file).to_pylist()
        except Exception as exc:
            raise UserError(f"cannot read parquet file `{file}`: {exc}") from exc
    rows = []
    with open(file, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{file}: row {number}: not valid JSON ({exc.msg}).") from None
            if not isinstance(row, dict):
                raise UserError(f"{file}: row {number}: expected a JSON object, got {type(row).__name__}.")
            rows.append(row)
    return rows


def read_hub(source: DataSource, offline: str = "") -> list[Example]:
    """Every row of a Hub dataset's split; `offline` says how to use local files instead (the task's own way)."""
    import datasets  # heavy, and only needed for Hub sources

    offline = offline or f"Point the task at local files: `task.data_dir=DIR` or {DATA_DIR_ENV}=DIR."
    try:
        dataset = datasets.load_dataset(source.path, source.name, split=source.split)
    except Exception as exc:
        raise UserError(
            f"cannot load Hub dataset `{source.path}` (config {source.name!r}, split {source.split!r}): {exc}. "
            f"Offline? {offline}"
        ) from exc
    return [dict(row) for row in dataset]


def _checked(rows: list[Example], required: Sequence[str], gold: Callable[[Example], str], where: str,
             skip: bool) -> list[Example]:
    kept, skipped = [], []
    for number, row in enumerate(rows, start=1):
        problem = _row_problem(row, required)
        answer = gold(row) if problem is None else ""
        if problem is None and not answer:
            problem = "has no final answer to grade against"
        if problem is None:
            kept.append({**row, "gold": answer})
        elif skip:
            skipped.append(number)
        else:
            raise UserError(f"{where}: row {number} {problem} (columns: {', '.join(row)}). "
                            "Fix the row, or set the task's `bad_rows: skip` to leave such rows out.")
    if skipped:
        warnings.warn(f"{where}: skipped {len(skipped)} bad rows (numbers {skipped[:20]})", stacklevel=3)
    return kept


def _row_problem(row: Example, required: Sequence[str]) -> str | None:
    for column in required:
        value: Any = row.get(column)
        if column not in row:
            return f"is missing column `{column}`"
        if value is None or (isinstance(value, str) and not value.strip()):
            return f"has an empty `{column}`"
    return None
