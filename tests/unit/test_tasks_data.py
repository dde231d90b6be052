"""Loading task rows from local JSONL / parquet files and (monkeypatched) Hub datasets; validation carving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpo.errors import UserError
from gpo.tasks.data import DataSource, SplitCache, carve_validation, read_rows, resolve
from gpo.tasks.gsm8k import GSM8K, GSM8KConfig

ROWS = [
    {"question": "1+1?", "answer": "so\n#### 2"},
    {"question": "2+2?", "answer": "so\n#### 4"},
    {"question": "3+3?", "answer": "so\n#### 6"},
]


def gold(row: dict) -> str:
    return row["answer"].split("#### ")[-1]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "train.jsonl", ROWS)
    rows = read_rows(DataSource(str(file)), required=("question", "answer"), gold=gold)
    assert [r["gold"] for r in rows] == ["2", "4", "6"]


def test_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "train.parquet")
    rows = read_rows(DataSource(str(tmp_path / "train.parquet")), required=("question", "answer"), gold=gold)
    assert [r["question"] for r in rows] == ["1+1?", "2+2?", "3+3?"]


def test_glob_reads_files_in_sorted_order(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "part-1.jsonl", ROWS[2:])
    write_jsonl(tmp_path / "part-0.jsonl", ROWS[:2])
    rows = read_rows(DataSource(str(tmp_path / "part-*.jsonl")), required=("question",), gold=gold)
    assert [r["gold"] for r in rows] == ["2", "4", "6"]


def test_hub_source_calls_load_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return ROWS[:2]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows = read_rows(DataSource("openai/gsm8k", "main", "test"), required=("question", "answer"), gold=gold)
    assert calls == [("openai/gsm8k", "main", "test")]
    assert [r["gold"] for r in rows] == ["2", "4"]


def test_hub_failure_says_how_to_go_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserError, match=r"openai/gsm8k.*task.data_dir"):
        read_rows(DataSource("openai/gsm8k", "main", "test"), required=("question",), gold=gold)


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"question": "4+4?"}, r"bad\.jsonl: row 2 is missing column `answer`"),
        ({"question": "4+4?", "answer": "  "}, r"bad\.jsonl: row 2 has an empty `answer`"),
        ({"question": "4+4?", "answer": "no marker"}, r"bad\.jsonl: row 2 has no final answer"),
    ],
)
def test_bad_row_names_file_and_row(tmp_path: Path, bad_row: dict, message: str) -> None:
    file = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], bad_row, ROWS[1]])
    task = GSM8K(GSM8KConfig(test=DataSource(str(file))))
    with pytest.raises(UserError, match=message):
        task.load("test")


def test_bad_rows_skip_leaves_them_out_with_a_warning(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"question": "4+4?"}, ROWS[1]])
    with pytest.warns(UserWarning, match=r"skipped 1 bad rows \(numbers \[2\]\)"):
        rows = read_rows(DataSource(str(file)), required=("question", "answer"), gold=gold, bad_rows="skip")
    assert [r["gold"] for r in rows] == ["2", "4"]


def test_invalid_json_and_missing_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "#### 1"}\n{not json\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"broken\.jsonl: row 2: not valid JSON"):
        read_rows(DataSource(str(broken)), required=("question",), gold=gold)
    with pytest.raises(UserError, match=r"nope\.jsonl` does not exist"):
        read_rows(DataSource(str(tmp_path / "nope.jsonl")), required=("question",), gold=gold)


def test_carve_validation_is_seeded_disjoint_and_complete() -> None:
    rows = [{"i": i} for i in range(10)]
    train, validation = carve_validation(rows, size=3, seed=7)
    again, validation_again = carve_validation(rows, size=3, seed=7)
    assert (train, validation) == (again, validation_again)
    assert len(validation) == 3 and len(train) == 7
    assert sorted(r["i"] for r in train + validation) == list(range(10))  # disjoint and nothing lost
    assert carve_validation(rows, size=3, seed=8)[1] != validation
    with pytest.raises(UserError, match="leaves no training rows"):
        carve_validation(rows, size=10, seed=0)


def test_split_cache_reads_each_stored_split_once() -> None:
    reads = []

    def read(split: str) -> list[dict]:
        reads.append(split)
        return [{"i": i, "split": split} for i in range(5)]

    cache = SplitCache(read, validation_size=2, seed=0)
    assert len(cache.get("train")) == 3 and len(cache.get("validation")) == 2 and len(cache.get("test")) == 5
    cache.get("train")
    assert reads == ["train", "test"]
    with pytest.raises(UserError, match="unknown split `dev`"):
        cache.get("dev")


def test_data_dir_and_environment_override_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    hub = DataSource("openai/gsm8k", "main", "test")
    monkeypatch.delenv("GPO_DATA_DIR", raising=False)
    assert resolve(hub, None, "gsm8k/test.jsonl") == hub
    assert resolve(hub, "/data", "gsm8k/test.jsonl").path == "/data/gsm8k/test.jsonl"
    monkeypatch.setenv("GPO_DATA_DIR", "/env")
    assert resolve(hub, None, "gsm8k/test.jsonl").path == "/env/gsm8k/test.jsonl"
    assert resolve({"path": "mine.jsonl"}, None, "gsm8k/test.jsonl").path == "mine.jsonl"  # local files stay
    assert resolve({"path": "mine.jsonl"}, "/data", "gsm8k/test.jsonl").path == "/data/gsm8k/test.jsonl"


@pytest.mark.parametrize("task", ["gsm8k", "math", "aime24", "amc23"])
def test_a_data_dir_that_does_not_exist_fails_at_compose_time(task: str, tmp_path: Path) -> None:
    """Before anything loads (`gpo run --dry-run` exits 2 with it), naming the key and the fix."""
    from gpo.config import compose

    with pytest.raises(UserError, match=rf"`task.data_dir`: `{tmp_path}/nope` does not exist\. Point it at an "
                                        "existing local directory"):
        compose([f"task={task}", f"task.data_dir={tmp_path}/nope"])
    file = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(UserError, match=r"is a file, not a directory"):
        compose([f"task={task}", f"task.data_dir={file}"])
    assert compose([f"task={task}", f"task.data_dir={tmp_path}"]).task.config.data_dir == str(tmp_path)
    assert compose([f"task={task}"]).task.config.data_dir is None  # unset: the Hub (or $GPO_DATA_DIR)


def test_composed_sources_are_data_sources_and_mappings_still_work(tmp_path: Path) -> None:
    """The composer validates `task.test.path=...` into a DataSource; a config built by hand may still hold a
    plain mapping, which `resolve` reads as one (as_source)."""
    from gpo.config import compose

    file = write_jsonl(tmp_path / "test.jsonl", ROWS)
    composed = compose(["task=gsm8k", f"task.test.path={file}"]).task.config
    assert isinstance(composed.test, DataSource) and composed.test.path == str(file)
    by_hand = GSM8K(GSM8KConfig(test={"path": str(file)}))  # type: ignore[arg-type]
    assert [r["gold"] for r in by_hand.load("test")] == ["2", "4", "6"]
