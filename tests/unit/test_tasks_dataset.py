"""`task=dataset`: loaders for each format, the four graders on hand-made completions, user reward functions in
TRL's convention (None, exceptions, NaN, timeout, the zero policy, weights), and refusals at compose time."""

from __future__ import annotations

import json
import sys

import pytest

from gpo import registry, user_code
from gpo.config import compose
from gpo.errors import UserError
from gpo.rewards import score
from gpo.tasks import graders
from kit import crowded_core

ROWS = [{"question": f"q{i}", "answer": str(i), "hint": f"h{i}"} for i in range(6)]
REWARDS = '''
import math, threading, time

release = threading.Event()  # set by a test when it is done with the calls it abandoned

def short(completions, **kwargs):
    return [float(len(c) < 5) for c in completions]

def uses_answer(prompts, completions, answer):
    return [None if c == "skip" else float(a in c) for c, a in zip(completions, answer)]

def picky(completions, **kwargs):
    if any("boom" in c for c in completions):
        raise ValueError("cannot parse")
    return [math.nan if "nan" in c else 1.0 for c in completions]

def slow(completions, **kwargs):
    if any("slow" in c for c in completions):
        release.wait(600)  # hung on something outside: uses no CPU
    return [1.0 for _ in completions]

def spin(completions, **kwargs):
    while not release.is_set():
        pass
    return [1.0 for _ in completions]

def crunch(completions, **kwargs):
    start = time.thread_time()  # 0.5 s of this thread's CPU time, however long the machine takes to give it
    while time.thread_time() - start < 0.5:
        pass
    return [1.0 for _ in completions]

def positional(x, /, completions):
    return [0.0]
'''


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = f"rw_{tmp_path.name.replace('-', '_')}"  # a fresh module per test: no import cache shared
    (tmp_path / f"{module}.py").write_text(REWARDS)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    yield tmp_path, module
    sys.modules.pop(module, None)


def build(*overrides: str):
    cfg = compose(["tracker=none", "task=dataset", "task.validation_size=1", *overrides])
    return registry.get("task", "dataset").build(cfg.task.config)


def test_every_format_and_a_folder_read_the_same_rows(data):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, _ = data
    (root / "t.json").write_text(json.dumps(ROWS))
    (root / "t.csv").write_text("question,answer,hint\n" + "".join(f"{r['question']},{r['answer']},{r['hint']}\n"
                                                                    for r in ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), root / "t.parquet")
    folder = root / "folder"
    folder.mkdir()
    (folder / "train-00000-of-00002.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    (folder / "train-00001-of-00002.csv").write_text("question,answer,hint\n" + "".join(
        f"{r['question']},{r['answer']},{r['hint']}\n" for r in ROWS[3:]))
    (folder / "test.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    expected = [dict(r, gold=r["answer"]) for r in ROWS]
    for path in ("train.jsonl", "t.json", "t.csv", "t.parquet", "folder"):
        task = build(f"task.path={path}", "task.validation_size=0")
        assert list(task.load("train")) == expected, path
    assert [r["question"] for r in build("task.path=folder").load("test")] == ["q0"]
    with pytest.raises(UserError, match="has no `test` split"):
        build("task.path=train.jsonl").load("test")


def test_validation_is_carved_seeded_and_disjoint(data):
    task = build("task.path=train.jsonl", "task.validation_size=2", "task.split_seed=3")
    train, validation = task.load("train"), task.load("validation")
    assert len(train) == 4 and len(validation) == 2
    assert not {r["question"] for r in train} & {r["question"] for r in validation}
    again = build("task.path=train.jsonl", "task.validation_size=2", "task.split_seed=3")
    assert list(again.load("validation")) == list(validation)


def test_the_template_fills_columns_and_an_unknown_one_is_refused(data):
    task = build("task.path=train.jsonl", "task.user_template='{question} (hint: {hint})'", "task.system_prompt=''")
    assert task.prompt(task.load("train")[0]) == [{"role": "user", "content": "q0 (hint: h0)"}]
    with pytest.raises(UserError, match=r"task.user_template '\{nope\}': `train.jsonl` has no column `nope`"):
        build("task.path=train.jsonl", "task.user_template='{nope}'").load("train")


def test_bad_rows_name_file_row_and_field(data):
    root, _ = data
    (root / "bad.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"question": "q", "answer": ""}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl: row 2 has an empty `answer`"):
        build("task.path=bad.jsonl", "task.validation_size=0").load("train")
    with pytest.raises(UserError, match=r"row 1 has a `answer` that does not hold exactly one number"):
        (root / "words.jsonl").write_text(json.dumps({"question": "q", "answer": "many"}) + "\n")
        build("task.path=words.jsonl", "task.grader=number", "task.validation_size=0").load("train")
    (root / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="no usable rows"):
        build("task.path=empty.jsonl", "task.validation_size=0").load("train")


def test_graders_on_hand_made_answers():
    assert graders.gold_text("number", "He has 3 + 4 = 7 apples.\n#### 1,234") == "1234"
    assert graders.correct("number", "$1,234.", "1234") and not graders.correct("number", "12 or 1234", "1234")
    assert graders.correct("exact", "The  \\text{Nile}.", "the nile") and not graders.correct("exact", "Nil", "Nile")
    assert graders.gold_text("choice", "(C)") == "C"
    assert [graders.choice_letter(t) for t in ("B", "(B)", "B) 12", "\\text{D}", "a cat", "Because")] == \
        ["B", "B", "B", "D", None, None]
    assert not graders.correct("choice", None, "B")


@pytest.mark.parametrize("grader,gold,right,wrong", [
    ("number", "12", "<think>t</think><answer>12</answer>", "<think>t</think><answer>13</answer>"),
    ("exact", "Paris", "<think>t</think><answer>paris</answer>", "<think>t</think><answer>Lyon</answer>"),
    ("choice", "B", "<think>t</think><answer>(B) 4</answer>", "<think>t</think><answer>A</answer>"),
    ("math", "\\frac{1}{2}", "<think>t</think><answer>\\boxed{0.5}</answer>", "<answer>\\boxed{2}</answer>"),
])
def test_each_grader_rewards_format_and_accuracy(data, grader, gold, right, wrong):
    root, _ = data
    (root / "one.jsonl").write_text(json.dumps({"question": "q", "answer": gold}) + "\n")
    task = build("task.path=one.jsonl", f"task.grader={grader}", "task.validation_size=0", "task.workers=1")
    row = task.load("train")[0]
    rewards = task.reward([right, wrong], [row, row])
    assert rewards.components["accuracy"] == [1.0, 0.0]
    assert rewards.components["format"] == [1.0, float(grader != "math")]
    assert rewards.total == [2.0, 1.0 if grader != "math" else 0.0]  # format_weight 1, accuracy_weight 1
    assert [g.correct for g in task.grade([right, wrong], [row, row])] == [True, False]
    task.close()


def test_user_rewards_in_trl_style_with_none_and_weights(data):
    _, mod = data
    task = build("task.path=train.jsonl", "task.grader=none", f"task.rewards=[{mod}:short,{mod}:uses_answer]",
                 "task.reward_weights=[0.5,2.0]", "task.pass_criterion=uses_answer", "task.validation_size=0")
    rows = list(task.load("train"))[:3]
    rewards = score(task, "dataset", ["0", "skip", "not 2 at all"], rows)
    assert rewards.components == {"short": [1.0, 1.0, 0.0], "uses_answer": [1.0, 0.0, 1.0]}
    assert rewards.total == [2.5, 0.5, 2.0]
    assert rewards.metrics == {"short_none": 0.0, "uses_answer_none": 1.0}
    assert [g.correct for g in task.grade(["0", "skip", "x"], rows)] == [True, False, False]


def test_a_raising_or_nan_reward_stops_naming_the_function_and_completion_or_scores_zero(data):
    _, mod = data
    task = build("task.path=train.jsonl", f"task.rewards=[{mod}:picky]")
    rows = list(task.load("train"))[:3]
    with pytest.raises(UserError, match=r"`picky`.*ValueError: cannot parse.*completion 1 of the batch alone: 'boom'"):
        score(task, "dataset", ["a", "boom", "c"], rows)
    with pytest.raises(UserError, match=r"`picky`.* returned nan for completion 2.*completion 2 of the batch alone"):
        score(task, "dataset", ["a", "b", "nan"], rows)
    zero = build("task.path=train.jsonl", f"task.rewards=[{mod}:picky]", "task.reward_errors=zero")
    rewards = score(zero, "dataset", ["a", "boom", "nan"], rows)
    assert rewards.components["picky"] == [1.0, 0.0, 0.0] and rewards.metrics["errors"] == 2.0


def test_a_hanging_reward_is_bounded_in_time(data):
    _, mod = data
    rows = list(build("task.path=train.jsonl").load("train"))[:2]
    task = build("task.path=train.jsonl", f"task.rewards=[{mod}:slow]", "task.reward_timeout_s=0.2")
    try:
        with pytest.raises(UserError, match=r"`slow`.*did not return within task.reward_timeout_s=0.2 s on 2 "
                                            r"completions \(waiting: no CPU used"):
            score(task, "dataset", ["slow", "b"], rows)
        zero = build("task.path=train.jsonl", f"task.rewards=[{mod}:slow]", "task.reward_timeout_s=0.2",
                     "task.reward_errors=zero")
        rewards = score(zero, "dataset", ["slow", "b"], rows)
        assert rewards.components["slow"] == [0.0, 1.0] and rewards.metrics["errors"] == 1.0
    finally:
        sys.modules[mod].release.set()


@pytest.mark.skipif(not user_code.CPU_CLOCKS, reason="no thread CPU clock here: the bound is wall time")
def test_a_spinning_reward_is_bounded_by_its_cpu_time(data, monkeypatch):
    _, mod = data
    # Only the CPU bound can stop it: the wall backstop is moved out of reach (600 s), and it never waits.
    monkeypatch.setattr(user_code, "WALL_FACTOR", 3000)
    rows = list(build("task.path=train.jsonl").load("train"))[:2]
    task = build("task.path=train.jsonl", f"task.rewards=[{mod}:spin]", "task.reward_timeout_s=0.2")
    try:
        with pytest.raises(UserError, match=r"`spin`.*did not return within task.reward_timeout_s=0.2 s on 2 "
                                            r"completions \(computing: "):
            score(task, "dataset", ["a", "b"], rows)
    finally:
        sys.modules[mod].release.set()  # the abandoned call stops spinning


@pytest.mark.skipif(not user_code.CPU_CLOCKS, reason="no thread CPU clock here: the bound is wall time")
def test_a_computing_reward_within_its_cpu_time_is_not_failed_by_load(data, monkeypatch):
    """0.5 CPU s against a 1 s bound, on a core shared four ways: 2 s of wall time or more, yet it passes."""
    _, mod = data
    monkeypatch.setattr(user_code, "WALL_FACTOR", 600)  # the wall backstop only stops a broken test here
    rows = list(build("task.path=train.jsonl").load("train"))[:2]
    task = build("task.path=train.jsonl", f"task.rewards=[{mod}:crunch]", "task.reward_timeout_s=1")
    with crowded_core():  # the call's thread starts on the crowded core
        rewards = score(task, "dataset", ["a", "b"], rows)
    assert rewards.components["crunch"] == [1.0, 1.0] and rewards.metrics.get("errors", 0.0) == 0.0


@pytest.mark.parametrize("overrides,message", [
    (["task.path=missing.jsonl"], "does not exist"),
    (["task.grader=fancy"], "must be one of math, number, exact, choice, none"),
    (["task.rewards=[no_such_module:f]"], "cannot import module `no_such_module`"),
    (["task.rewards=[{mod}:positional]"], "cannot be called as fn\\(completions=..., \\*\\*kwargs\\)"),
    (["task.rewards=[{mod}:short]", "task.reward_weights=[1,2]"], "2 weights for 1 task.rewards"),
    (["task.pass_criterion=nope"], "names no reward component; the components are format, accuracy"),
    (["task.grader=none", "task.rewards=[{mod}:short]"], "`accuracy` names no reward component"),
    (["task.grader=none"], "nothing would reward the model"),
    (["task.user_template='{{}}'"], "is not a column name"),
])
def test_bad_config_is_refused_at_compose_time(data, overrides, message):
    _, mod = data
    with pytest.raises(UserError, match=message):
        compose(["tracker=none", "task=dataset", "task.path=train.jsonl", *[o.format(mod=mod) for o in overrides]])
