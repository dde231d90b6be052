"""`aime24` and `amc23`: evaluation-only sets read from a local data folder, graded as whole numbers."""

from __future__ import annotations

import pytest

from gpo import cli, registry
from gpo.errors import UserError
from gpo.tasks.competition import same_integer

registry.load_builtins()


def _task(name: str, data):
    return registry.get("task", name).build({"data_dir": str(data)})


@pytest.mark.parametrize("name,rows", [("aime24", 30), ("amc23", 40)])
def test_the_sets_load_from_the_local_copy(name, rows, shared_data):
    examples = _task(name, shared_data).load("test")
    assert len(examples) == rows and all(ex["gold"] for ex in examples)
    messages = _task(name, shared_data).prompt(examples[0])
    assert messages[-1] == {"role": "user", "content": examples[0]["problem"]}


def test_aime_answers_are_zero_padded_and_compared_as_numbers(shared_data):
    task = _task("aime24", shared_data)
    padded = next(ex for ex in task.load("test") if ex["gold"] == "025")
    completions = ["<think>...</think>\n<answer> \\boxed{25} </answer>",  # right, formatted
                   "the answer is \\boxed{25.0}",  # right, no R1 layout
                   "<think>...</think>\n<answer> \\boxed{250} </answer>",  # wrong
                   "<think>...</think>\n<answer> 24 or 25 </answer>",  # two numbers: not an answer
                   "no box at all 25"]  # nothing extracted (as in the math task)
    grades = task.grade(completions, [padded] * len(completions))
    assert [g.correct for g in grades] == [True, True, False, False, False]
    assert [g.formatted for g in grades] == [True, False, True, True, False]
    assert grades[0].extracted == "25" and grades[4].extracted is None
    assert task.reward(completions[:1], [padded]).total == [3.0]  # the math scale: format 1 + accuracy 2


def test_same_integer():
    assert same_integer("025", "25") and same_integer("-1", "-1") and same_integer("1{,}625", "1625")
    assert not same_integer(None, "1") and not same_integer("x", "1") and not same_integer("1 2", "1")


@pytest.mark.parametrize("name", ["aime24", "amc23"])
@pytest.mark.parametrize("split", ["train", "validation"])
def test_they_cannot_be_trained_on(name, split, shared_data):
    with pytest.raises(UserError, match=f"`{name}` is an evaluation-only set.*eval.tasks=\\[{name}\\]"):
        _task(name, shared_data).load(split)


def test_gpo_run_on_an_evaluation_set_is_a_clear_user_error(tiny_model_path, shared_data, tmp_path, capsys):
    code = cli.main(["run", f"model={tiny_model_path}", "task=amc23", f"task.data_dir={shared_data}",
                     "tracker=none", f"output_dir={tmp_path}", "train.steps=1"])
    assert code == 2
    assert "`amc23` is an evaluation-only set" in capsys.readouterr().err


def test_gpo_eval_scores_an_evaluation_set(tiny_model_path, shared_data, tmp_path, capsys):
    import json

    code = cli.main(["eval", f"model={tiny_model_path}", "task=aime24", f"task.data_dir={shared_data}", "limit=2",
                     "tracker=none", f"output_dir={tmp_path}", "train.max_completion_length=4"])
    assert code == 0
    (run_dir,) = tmp_path.glob("eval-aime24-test-*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["n"] == 2 and summary["accuracy"] == 0.0  # a random 2-layer model does not solve AIME
