"""Reading a user's table (`task=dataset`): a local JSONL, JSON, CSV or Parquet file, a folder of them, or a Hub
dataset.

A folder is split the way Hugging Face `datasets` splits one: the files of split `train` are those named
`train.*` / `train-00000-of-00002.*` / `train_*.*`, or every file under a `train/` subfolder; a folder whose
files name no split at all is all train (`task.train_split` / `task.test_split` name other splits). A single
file is the train split only. Rows come back as plain dicts, in file order; nothing here judges a row
(tasks/dataset.py does, naming the file and the row).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from gpo.errors import UserError
from gpo.tasks import data
from gpo.types import Example

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
SPLIT_NAMES = ("train", "test", "validation", "valid", "dev")  # names that mark a file as one split's
CSV_ENCODING = "utf-8-sig"  # UTF-8, without the byte-order mark spreadsheets write before the first column's name
HEAD_ROWS = 50  # the JSON rows whose keys stand for a file's columns before it is read whole
HEAD_JSON_BYTES = 32 << 20  # a JSON array this large is not parsed just to learn its columns


def is_local(path: str) -> bool:
    """A path on this machine: what the built-in tasks read as local (gpo.tasks.data.is_local), and also any
    table file or explicit path that does not exist yet, so that a typo fails as a missing file, not as a Hub
    dataset; anything else is a Hub dataset name."""
    return data.is_local(path) or path.endswith(SUFFIXES) or path.startswith((".", "/", "~"))


def check_local(path: str) -> None:
    """A local path that does not exist, or a folder without a single table file, fails now (at compose time)."""
    where = Path(path).expanduser()
    if not where.exists():
        raise UserError(f"task.path `{path}` does not exist (relative paths are read from the directory gpo runs "
                        "in). Give a .jsonl, .json, .csv or .parquet file, a folder of them, or a Hub dataset name.")
    if where.is_dir() and not _tables(where):
        raise UserError(f"task.path `{path}` is a folder without any {', '.join(SUFFIXES)} file.")
    if where.is_file() and where.suffix not in SUFFIXES:
        raise UserError(f"task.path `{path}`: cannot read `{where.suffix or 'suffix-less'}` files; give a "
                        f"{', '.join(SUFFIXES)} file.")


def split_files(path: str, split: str, train_split: str, test_split: str) -> list[Path]:
    """The files that hold `split` under the local `path` ([] when there are none)."""
    where = Path(path).expanduser()
    if where.is_file():
        return [where] if split == train_split else []
    known = {train_split, test_split, *SPLIT_NAMES}
    tables = _tables(where)
    named = [f for f in tables if _split_of(f, where, known) is not None]
    if not named:  # a folder of files that name no split is all train, as `datasets` reads it
        return tables if split == train_split else []
    return [f for f in named if _split_of(f, where, known) == split]


def read_table(file: Path) -> list[Example]:
    """Every row of one local file, as dicts."""
    if file.suffix == ".csv":
        with open(file, encoding=CSV_ENCODING, newline="") as handle:
            return [dict(row) for row in csv.DictReader(handle)]
    if file.suffix == ".json":
        return _read_json(file)
    return data.read_local(file)  # .jsonl and .parquet, as the built-in tasks read them


def columns(file: Path) -> list[str] | None:
    """The columns of one local file, read cheaply (a CSV's header, a Parquet file's schema, the keys of the first
    JSON rows), so that a setting naming a column the file lacks fails before any model loads; None when nothing
    says (an empty file: the full read reports it) or when that would mean parsing a large JSON array whole."""
    try:
        return _columns(file)
    except UnicodeDecodeError as exc:
        raise UserError(f"`{file}` is not UTF-8 text ({exc.reason} at byte {exc.start}): save it as UTF-8.") from None
    except OSError as exc:
        raise UserError(f"cannot read `{file}`: {exc.strerror or exc}.") from None


def _columns(file: Path) -> list[str] | None:
    if file.suffix == ".csv":
        with open(file, encoding=CSV_ENCODING, newline="") as handle:
            return next(csv.reader(handle), None)
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq  # comes with `datasets`; imported only when a parquet file is named

        try:
            return list(pq.read_schema(file).names)
        except Exception as exc:
            raise UserError(f"cannot read parquet file `{file}`: {exc}") from exc
    if file.suffix == ".json" and file.stat().st_size > HEAD_JSON_BYTES:
        return None
    rows = _read_json(file) if file.suffix == ".json" else _head_lines(file)
    return list(dict.fromkeys(key for row in rows[:HEAD_ROWS] for key in row)) or None


def _head_lines(file: Path) -> list[Example]:
    """The first JSON-lines rows that parse as objects (a broken line is left to the full read to name)."""
    rows: list[Example] = []
    with open(file, encoding="utf-8") as handle:
        for line in handle:
            if len(rows) == HEAD_ROWS:
                break
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                break
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _read_json(file: Path) -> list[Example]:
    """A JSON array of objects, an object holding one such array (e.g. {"data": [...]}), or JSON lines."""
    text = file.read_text(encoding="utf-8")
    try:
        content = json.loads(text)
    except json.JSONDecodeError:
        return data.read_local(file)  # JSON lines under a .json name, as `datasets` accepts them
    if isinstance(content, dict):
        arrays = [v for v in content.values() if isinstance(v, list)]
        if len(arrays) != 1:
            raise UserError(f"{file}: a JSON object must hold exactly one list of rows, found {len(arrays)}.")
        content = arrays[0]
    if not isinstance(content, list):
        raise UserError(f"{file}: expected a list of JSON objects, got {type(content).__name__}.")
    for number, row in enumerate(content, start=1):
        if not isinstance(row, dict):
            raise UserError(f"{file}: row {number}: expected a JSON object, got {type(row).__name__}.")
    return content


def _tables(folder: Path) -> list[Path]:
    return sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix in SUFFIXES)


def _split_of(file: Path, folder: Path, known: set[str]) -> str | None:
    """The split a file's name or its first subfolder names ('train' for train.jsonl, train-00000-of-00002.parquet
    and train/part-1.csv), None when it names none of `known`."""
    parts = file.relative_to(folder).parts
    if len(parts) > 1:
        return parts[0] if parts[0] in known else None
    stem = file.name[: -len(file.suffix)]
    return next((s for s in sorted(known) if stem == s or stem.startswith((f"{s}-", f"{s}_", f"{s}."))), None)


def sample_rows(split: str) -> list[Example]:
    """The rows `task=dataset` reads when `task.path` is empty: 64 train and 16 test sums of two small numbers, the
    same on every machine, so the task runs as shipped and shows the row layout it expects."""
    start, count = (0, 64) if split == "train" else (64, 16)
    return [{"question": f"What is {3 + 7 * i % 41} + {5 + 11 * i % 37}?", "answer": str(8 + 7 * i % 41 + 11 * i % 37)}
            for i in range(start, start + count)]
