"""One rule for "right": `gpo.types.passes` (criterion > PASS_THRESHOLD) on the task's pass criterion, whatever
component the task names, read alike by DAPO's group filter (through the step), the selectors, the step's success
rate and the tasks' grades (so evaluation). Values below are derived by hand."""

from __future__ import annotations

import json

import pytest
import torch

from gpo import registry
from gpo.config import compose
from gpo.errors import UserError
from gpo.rollout_phases import rewards_by_question
from gpo.step_math import score_groups
from gpo.types import PASS_THRESHOLD, RolloutBatch, pass_criterion, passes
from kit import REPO

registry.load_builtins()
G = 4
DATA = REPO.parent / "shared" / "data"


def dapo(**cfg):
    return registry.get("algo", "dapo").build(registry.get("algo", "dapo").config(**cfg), max_completion_length=8)


def rows(components: dict[str, list[float]], total: list[float]) -> RolloutBatch:
    """One-token rows in groups of G carrying the given reward components."""
    n = len(total)
    one = torch.ones((n, 1), dtype=torch.long)
    return RolloutBatch(prompt_ids=one, prompt_mask=one, completion_ids=one, completion_mask=one,
                        group_ids=torch.arange(n) // G, rewards=torch.tensor(total), advantages=torch.zeros(n),
                        truncated=torch.zeros(n, dtype=torch.bool), owner_rank=torch.zeros(n, dtype=torch.long),
                        reward_components={k: torch.tensor(v) for k, v in components.items()})


def test_a_completion_passes_when_its_criterion_is_above_the_threshold():
    assert PASS_THRESHOLD == 0.0
    scores = torch.tensor([-1.0, 0.0, 1e-6, 0.5, 1.5, 2.0])
    assert passes(scores).tolist() == [False, False, True, True, True, True]
    assert passes(scores, threshold=1.0).tolist() == [False, False, False, False, True, True]
    assert passes(0.0) is False and passes(1.5) is True and passes(1.0, threshold=1.0) is False


# Four groups of a task whose pass criterion is the user's `uses_answer` (no `accuracy` component at all):
#   group 0  [1, 0, 0, 0]      one passes       -> mixed: kept
#   group 1  [1, 1, 1, 1]      all pass          -> dropped
#   group 2  [0, 0, 0, 0]      all fail          -> dropped
#   group 3  [2, 0.5, 0.5, 2]  all pass (> 0), though the values differ -> dropped
#   group 4  [0, -1, 0, 0]     all fail (<= 0), though the values differ -> dropped
#   group 5  [0, 0, 3, 0]      one passes        -> mixed: kept
CRITERION = [1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 2, 0.5, 0.5, 2, 0, -1, 0, 0, 0, 0, 3, 0]
# `format` varies in every group and the total with it: neither may decide
FORMAT = [0, 1, 0, 1] * 6
EXPECTED = [True, False, False, False, False, True]


def test_dapo_filters_on_a_criterion_not_named_accuracy_through_the_step():
    batch = rows({"uses_answer": CRITERION, "format": FORMAT}, [c + f for c, f in zip(CRITERION, FORMAT)])
    _, group_mask = score_groups(dapo(overlong_penalty=False), batch, G, pass_key="uses_answer")
    assert group_mask.tolist() == EXPECTED
    # the objective's own interface, given the verdicts as the step gives them
    shaped = batch.rewards.view(-1, G)
    passed = passes(batch.reward_components["uses_answer"]).view(-1, G)
    components = {k: v.view(-1, G) for k, v in batch.reward_components.items()}
    assert dapo().group_filter(shaped, components, passed=passed).tolist() == EXPECTED
    assert dapo(filter_on="total").group_filter(shaped, components, passed=passed).tolist() == [True] * 6
    assert dapo(dynamic_sampling=False).group_filter(shaped, components, passed=passed).tolist() == [True] * 6
    # the criterion wins over an `accuracy` component that says otherwise (here: flat in groups 0 and 5)
    with_accuracy = rows({"uses_answer": CRITERION, "accuracy": [1.0] * 24}, CRITERION)
    assert score_groups(dapo(), with_accuracy, G, pass_key="uses_answer")[1].tolist() == EXPECTED


def test_dapo_without_the_steps_verdicts_filters_on_accuracy_as_before():
    # Called as before, (rewards, components): the `accuracy` values must vary. Through the step the verdicts
    # decide: GSM8K's 2 (exact) and 1.5 (an equal number) both pass, so such a group has nothing to learn from.
    accuracy = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [2.0, 1.5, 2.0, 2.0], [0.0, 1.5, 0.0, 0.0]])
    assert dapo().group_filter(accuracy, {"accuracy": accuracy}).tolist() == [True, False, True, True]
    batch = rows({"accuracy": accuracy.flatten().tolist()}, accuracy.flatten().tolist())
    assert score_groups(dapo(), batch, G)[1].tolist() == [True, False, False, True]
    with pytest.raises(UserError, match=r"pass criterion .* reports \['format'\]; set algo.filter_on=total"):
        dapo().group_filter(accuracy, {"format": accuracy})
    # a step whose task lacks its criterion component gives no verdicts: the same clear error
    batch = rows({"format": FORMAT}, FORMAT)
    with pytest.raises(UserError, match="filter_on=total"):
        score_groups(dapo(), batch, G, pass_key="uses_answer")


def test_selectors_and_the_filter_read_the_same_verdicts():
    batch = rows({"uses_answer": CRITERION}, CRITERION)
    question = torch.arange(24) // G
    records = rewards_by_question(batch, question, 6, pass_key="uses_answer")
    assert [r.passed.tolist() for r in records][3] == [1.0, 1.0, 1.0, 1.0]  # [2, 0.5, 0.5, 2]
    screen = registry.get("selector", "screen").build(None)
    assert [screen.outcome(r) is None for r in records] == EXPECTED  # mixed exactly where DAPO keeps the group


REWARDS = '''
def uses_answer(completions, answer, **kwargs):
    return [2.0 if a in c else (0.5 if c.startswith(a[0]) else 0.0) for c, a in zip(completions, answer)]
'''


def _task(tmp_path, monkeypatch, *overrides):
    monkeypatch.chdir(tmp_path)
    module = f"pc_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"question": "What is 6 * 7?", "answer": "42"}) + "\n")
    cfg = compose(["task=dataset", "task.path=rows.jsonl", "task.validation_size=0",
                   f"task.rewards=[{module}:uses_answer]", *overrides])
    return cfg, registry.build(cfg.task)


COMPLETIONS = ["<think>t</think><answer>42</answer>", "<think>t</think><answer>4</answer>", "no answer", "41"]


@pytest.mark.parametrize("overrides", [
    ["task.grader=none", "task.pass_criterion=uses_answer", "algo=dapo"],
    ["task.grader=number", "task.pass_criterion=uses_answer"],
    ["task.grader=number"],
])
def test_a_dataset_tasks_grade_is_passes_of_its_criterion(tmp_path, monkeypatch, overrides):
    cfg, task = _task(tmp_path, monkeypatch, *overrides)  # composes: `--dry-run` accepts it
    row = task.load("train")[0]
    scored = task.reward(COMPLETIONS, [row] * 4)
    criterion = scored.components[pass_criterion(task)]
    grades = task.grade(COMPLETIONS, [row] * 4)
    assert [g.correct for g in grades] == [passes(c) for c in criterion]
    assert any(g.correct for g in grades) and not all(g.correct for g in grades)
    task.close()


def test_a_dapo_run_with_no_criterion_component_is_refused_when_composed(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="task.pass_criterion `accuracy` names no reward component"):
        _task(tmp_path, monkeypatch, "task.grader=none", "algo=dapo")


def _builtin_tasks():
    out = [("arith", {})]
    if DATA.is_dir():
        out += [("gsm8k", {"data_dir": str(DATA)})]
    return out


@pytest.mark.parametrize("name,settings", _builtin_tasks())
def test_a_builtin_tasks_grade_is_passes_of_its_criterion(name, settings):
    entry = registry.get("task", name)
    task = entry.build(settings)
    example = task.load("test")[0]
    gold = str(example["gold"])
    completions = [f"<think>t</think><answer>{gold}</answer>", f"<think>t</think><answer>{gold}1</answer>",
                   f"{gold}", "nothing"]
    scored = task.reward(completions, [example] * 4)
    criterion = scored.components[pass_criterion(task)]
    grades = task.grade(completions, [example] * 4)
    assert [g.correct for g in grades] == [passes(c) for c in criterion]
    assert grades[0].correct and not grades[1].correct
    task.close()


def test_a_plug_in_filter_without_verdicts_still_runs():
    """An objective whose `group_filter` override predates the `passed` verdicts is called as it was written."""
    from gpo.algorithms.grpo import GRPO, GRPOConfig
    from gpo.step_math import group_filter

    class TwoArgumentFilter(GRPO):
        def group_filter(self, rewards, components):  # noqa: D102  (the interface before verdicts)
            return components["accuracy"].sum(dim=1) > 0  # [B]

    batch = rows({"accuracy": [1.0, 0.0, 0.0, 0.0]}, total=[1.0, 0.0, 0.0, 0.0])
    shaped = batch.rewards.view(-1, 2)
    assert group_filter(TwoArgumentFilter(GRPOConfig()), batch, shaped, group_size=2).tolist() == [True, False]
