"""`task=dataset` with the names a user brings: columns named `q`/`a` or `prompt`/`solution` (or with a space and
capitals) need only task.question_field / task.answer_field; a template typed on the command line (`{q}`, which YAML
reads as a mapping) is kept as text; a setting naming a column the file lacks, and an output_dir nobody can create,
are refused by `gpo run --dry-run` with exit 2 before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpo import cli, registry
from gpo.config import compose
from gpo.errors import UserError
from gpo.tasks import files

QUICK = ["tracker=none", "backend=hf", "task=dataset"]
CSV_ROWS = [("What is 2 + 3?", "5"), ("What is 7 - 4?", "3"), ("What is 6 * 7?", "42"), ("What is 9 + 1?", "10")]
JSONL_ROWS = [{"prompt": f"What is {i} + {i}?", "solution": str(2 * i), "My Hint": f"double {i}"} for i in range(4)]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A user's folder: mine.csv (columns q, a) and mine.jsonl (prompt, solution, `My Hint`), gpo run inside it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.csv").write_text("q,a\n" + "".join(f"{q},{a}\n" for q, a in CSV_ROWS))
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in JSONL_ROWS))
    return tmp_path


def dry_run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["run", *QUICK, *args, "--dry-run"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def refused(capsys, *args: str) -> str:
    """The one error line of a refused `gpo run ... --dry-run` (exit 2, nothing on stdout)."""
    code, out, err = dry_run(capsys, *args)
    assert code == 2 and out == "", (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpo: error: "), err
    return lines[0]


def task_of(*args: str):
    cfg = compose(["tracker=none", "task=dataset", "task.validation_size=0", *args])
    return registry.get("task", "dataset").build(cfg.task.config)


# --- the default template follows task.question_field -----------------------------------------------------------


def test_only_the_two_fields_are_needed_for_a_csv_with_its_own_column_names(folder):
    task = task_of("task.path=mine.csv", "task.question_field=q", "task.answer_field=a", "task.system_prompt=''")
    rows = task.load("train")
    assert [r["gold"] for r in rows] == [a for _, a in CSV_ROWS]
    assert task.prompt(rows[2]) == [{"role": "user", "content": CSV_ROWS[2][0]}]


def test_a_jsonl_column_with_a_space_and_capitals_fills_the_template(folder):
    task = task_of("task.path=mine.jsonl", "task.question_field=prompt", "task.answer_field=solution",
                   "task.user_template={question} (hint: {My Hint})", "task.system_prompt=''")
    row = task.load("train")[1]
    assert task.prompt(row) == [{"role": "user", "content": "What is 1 + 1? (hint: double 1)"}]
    assert row["gold"] == "2"


def test_a_byte_order_mark_before_the_first_csv_column_is_not_part_of_its_name(folder):
    (folder / "excel.csv").write_bytes("q,a\nWhat is 1 + 1?,2\n".encode("utf-8-sig"))
    assert files.columns(folder / "excel.csv") == ["q", "a"]
    task = task_of("task.path=excel.csv", "task.question_field=q", "task.answer_field=a")
    assert [r["q"] for r in task.load("train")] == ["What is 1 + 1?"]


def test_json_lines_under_a_json_name_are_read(folder):
    (folder / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in JSONL_ROWS))
    assert files.columns(folder / "lines.json") == ["prompt", "solution", "My Hint"]
    task = task_of("task.path=lines.json", "task.question_field=prompt", "task.answer_field=solution")
    assert [r["gold"] for r in task.load("train")] == [r["solution"] for r in JSONL_ROWS]


# --- a template typed on the command line ---------------------------------------------------------------------


@pytest.mark.parametrize("typed,kept", [
    ("{q}", "{q}"),                     # YAML: the mapping {q: null}
    ("Q: {q}", "Q: {q}"),               # YAML: the mapping {Q: {q: null}}
    ("{q} and then {a}", "{q} and then {a}"),  # not YAML at all
    ('"{q}"', "{q}"),                   # quoted for YAML: the quotes are YAML's, not the template's
])
def test_a_template_from_the_command_line_is_kept_as_typed(folder, capsys, typed, kept):
    code, out, err = dry_run(capsys, "task.path=mine.csv", "task.question_field=q", "task.answer_field=a",
                             f"task.user_template={typed}")
    assert code == 0, err
    assert compose_printed(out)["task"]["user_template"] == kept


def compose_printed(out: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.create(out))  # type: ignore[return-value]


def test_only_text_fields_keep_the_text_a_number_or_a_list_is_still_read_as_yaml(folder, capsys):
    assert "`train.steps` has the wrong type" in refused(capsys, "task.path=mine.csv", "task.question_field=q",
                                                         "task.answer_field=a", "train.steps={q}")
    assert refused(capsys, "train.steps=[1").startswith("gpo: error: cannot parse overrides train.steps=[1")
    code, out, err = dry_run(capsys, "task.path=mine.csv", "task.question_field=q", "task.answer_field=a",
                             "train.steps=3", "task.rewards=[]", "run_name=2024")
    assert code == 0, err
    printed = compose_printed(out)
    assert printed["train"]["steps"] == 3 and printed["task"]["rewards"] == [] and printed["run_name"] == "2024"


def test_null_for_a_text_field_stays_null(folder, capsys):
    assert "`task.user_template` has the wrong type" in refused(capsys, "task.path=mine.csv",
                                                                "task.question_field=q", "task.user_template=null")


# --- columns the settings name, checked against the file at --dry-run -------------------------------------------


def test_the_default_fields_on_a_file_with_other_names_are_refused_naming_the_settings(folder, capsys):
    line = refused(capsys, "task.path=mine.csv")
    assert "task.question_field=question" in line and "`mine.csv` has no column `question`" in line
    assert "(its columns: q, a)" in line and "task.answer_field" in line


def test_a_field_naming_a_missing_column_is_refused_with_the_closest_one(folder, capsys):
    line = refused(capsys, "task.path=mine.jsonl", "task.question_field=promt", "task.answer_field=solution")
    assert "task.question_field=promt" in line and "no column `promt`" in line
    assert "(its columns: prompt, solution, My Hint)" in line and "Did you mean `prompt`?" in line
    line = refused(capsys, "task.path=mine.csv", "task.question_field=q", "task.answer_field=answer")
    assert "task.answer_field=answer" in line and "no column `answer`" in line


def test_a_template_naming_a_missing_column_is_refused(folder, capsys):
    line = refused(capsys, "task.path=mine.jsonl", "task.question_field=prompt", "task.answer_field=solution",
                   "task.user_template={question} (hint: {my hint})")
    assert "task.user_template '{question} (hint: {my hint})'" in line and "no column `my hint`" in line
    assert "Did you mean `My Hint`?" in line


def test_without_a_grader_the_answer_column_is_not_needed(folder, capsys, monkeypatch):
    (folder / "judge_rewards.py").write_text("def short(completions, **kwargs):\n"
                                             "    return [float(len(c) < 9) for c in completions]\n")
    monkeypatch.syspath_prepend(str(folder))
    code, _, err = dry_run(capsys, "task.path=mine.csv", "task.question_field=q", "task.grader=none",
                           "task.rewards=[judge_rewards:short]", "task.pass_criterion=short")
    assert code == 0, err


def test_a_reward_function_argument_that_is_no_column_is_refused(folder, capsys, monkeypatch):
    (folder / "user_rewards_cols.py").write_text("def by_level(completions, level):\n"
                                                 "    return [1.0 for _ in completions]\n")
    monkeypatch.syspath_prepend(str(folder))
    line = refused(capsys, "task.path=mine.csv", "task.question_field=q", "task.answer_field=a",
                   "task.rewards=[user_rewards_cols:by_level]")
    assert "task.rewards `user_rewards_cols:by_level` (its argument `level`)" in line and "no column `level`" in line


def test_parquet_json_and_a_folder_are_checked_per_file(folder, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(JSONL_ROWS), folder / "mine.parquet")
    (folder / "mine.json").write_text(json.dumps({"data": JSONL_ROWS}))
    for path in ("mine.parquet", "mine.json"):
        line = refused(capsys, f"task.path={path}", "task.question_field=prompt", "task.answer_field=answer")
        assert f"`{path}` has no column `answer`" in line, line
        code, _, err = dry_run(capsys, f"task.path={path}", "task.question_field=prompt",
                               "task.answer_field=solution")
        assert code == 0, err
    split = folder / "split"
    split.mkdir()
    (split / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in JSONL_ROWS))
    (split / "test.csv").write_text("prompt,answer\nWhat is 1 + 1?,2\n")  # the test split names its answer apart
    line = refused(capsys, "task.path=split", "task.question_field=prompt", "task.answer_field=solution")
    assert "test.csv` has no column `solution` (its columns: prompt, answer)" in line, line


def test_the_built_in_sample_is_checked_too(capsys):
    line = refused(capsys, "task.question_field=q")
    assert "the built-in sample" in line and "no column `q`" in line and "(its columns: question, answer)" in line


def test_a_gold_column_is_refused_before_the_run(folder, capsys):
    (folder / "gold.csv").write_text("q,a,gold\nWhat is 1 + 1?,2,2\n")
    line = refused(capsys, "task.path=gold.csv", "task.question_field=q", "task.answer_field=a")
    assert "`gold.csv` has a column `gold`" in line and "rename it" in line


def test_an_empty_file_is_left_to_the_full_read(folder):
    (folder / "empty.jsonl").write_text("")
    assert files.columns(folder / "empty.jsonl") is None
    with pytest.raises(UserError, match="no usable rows"):
        task_of("task.path=empty.jsonl").load("train")


def test_a_file_that_is_not_utf8_is_refused_naming_it(folder, capsys):
    (folder / "latin.csv").write_bytes("q,a\nCombien font 2 + 2 ? \xe9,4\n".encode("latin-1"))
    line = refused(capsys, "task.path=latin.csv", "task.question_field=q", "task.answer_field=a")
    assert "`latin.csv` is not UTF-8 text" in line


# --- an output_dir that cannot be created ---------------------------------------------------------------------


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_dir_under_proc_is_refused_even_for_root(folder, capsys):
    # The permission bits let root through here; the system still refuses every new folder under /proc.
    line = refused(capsys, "task.path=mine.csv", "task.question_field=q", "task.answer_field=a",
                   "output_dir=/proc/gpo-runs")
    assert line.startswith("gpo: error: output_dir=/proc/gpo-runs: cannot create the run folder"), line


def test_the_write_check_leaves_nothing_behind(folder, capsys):
    before = sorted(p.name for p in folder.iterdir())
    code, _, err = dry_run(capsys, "task.path=mine.csv", "task.question_field=q", "task.answer_field=a",
                           f"output_dir={folder}")
    assert code == 0, err
    assert sorted(p.name for p in folder.iterdir()) == before


def test_an_unquoted_template_in_a_yaml_file_is_refused_with_the_quoting_that_works(folder, capsys):
    """YAML reads `user_template: {q}` as the mapping {q: null}; the error shows the quoted form, which works."""
    bad, good = folder / "bad.yaml", folder / "good.yaml"
    bad.write_text("task:\n  name: dataset\n  user_template: {q}\n")
    assert cli.main(["run", "--dry-run", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "`task.user_template` has the wrong type" in err and 'quote a template: `user_template: "{q}"`' in err
    good.write_text('task:\n  name: dataset\n  user_template: "Q: {q}"\n')
    cfg = compose([f"task.path={folder / 'mine.csv'}", "task.question_field=q", "task.answer_field=a"], [good])
    assert cfg.task.config.user_template == "Q: {q}"
