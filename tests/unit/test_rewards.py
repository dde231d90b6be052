"""Guarded scoring (gpo/rewards.py): a reward function that raises or returns NaN stops the run with a message naming
the task, or, for a task that opts in with `reward_errors = "zero"`, scores that completion 0 and counts it."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpo import registry
from gpo.config import compose
from gpo.errors import UserError
from gpo.rewards import score
from gpo.types import Rewards

sys.path.insert(0, str(Path(__file__).parents[1] / "plugins"))


class Picky:
    """Scores len(completion); raises on a completion containing "boom", returns NaN on one containing "nan"."""

    def __init__(self, reward_errors: str | None = None) -> None:
        if reward_errors is not None:
            self.reward_errors = reward_errors
        self.calls = 0

    def reward(self, completions, examples):
        self.calls += 1
        values = []
        for c in completions:
            if "boom" in c:
                raise ValueError(f"cannot parse {c!r}")
            values.append(math.nan if "nan" in c else float(len(c)))
        return Rewards(total=values, components={"length": values, "one": [1.0] * len(values)},
                       metrics={"parsed": float(len(values))})


EXAMPLES = [{"q": 1}, {"q": 2}, {"q": 3}]


def test_a_clean_batch_is_scored_in_one_call_and_left_as_it_is():
    task = Picky()
    rewards = score(task, "picky", ["ab", "abc", "a"], EXAMPLES)
    assert rewards.total == [2.0, 3.0, 1.0] and rewards.metrics == {"parsed": 3.0}
    assert task.calls == 1
    opted_in = score(Picky("zero"), "picky", ["ab", "abc", "a"], EXAMPLES)
    assert opted_in.metrics == {"parsed": 3.0, "errors": 0.0}  # the count is logged from the first step on


def test_a_raising_reward_stops_the_run_naming_the_task_exception_place_and_completion():
    with pytest.raises(UserError) as caught:
        score(Picky(), "picky", ["ab", "kaboom", "a"], EXAMPLES)
    message = str(caught.value)
    assert message.startswith("task `picky`: reward raised ValueError: cannot parse 'kaboom' at ")
    assert "test_rewards.py:" in message and "in reward" in message  # where it was raised
    assert "It fails on completion 1 of the batch alone: 'kaboom'." in message
    assert 'reward_errors = "zero"' in message  # the way out, named


def test_opted_in_task_scores_the_failing_completion_zero_and_counts_it():
    rewards = score(Picky("zero"), "picky", ["ab", "kaboom", "a"], EXAMPLES)
    assert rewards.total == [2.0, 0.0, 1.0]
    assert rewards.components == {"length": [2.0, 0.0, 1.0], "one": [1.0, 0.0, 1.0]}
    assert rewards.metrics == {"parsed": 2.0, "errors": 1.0}  # the task's own counts summed over the good ones


def test_a_nan_score_is_never_passed_on():
    with pytest.raises(UserError, match=r"task `picky`: reward raised ValueError: `total` of completion 1 is nan, "
                                        r"not a finite number"):
        score(Picky(), "picky", ["ab", "nan!", "a"], EXAMPLES)
    rewards = score(Picky("zero"), "picky", ["ab", "nan!", "a"], EXAMPLES)
    assert rewards.total == [2.0, 0.0, 1.0] and rewards.metrics["errors"] == 1.0


def test_a_reward_that_fails_on_everything_is_broken_even_when_opted_in():
    with pytest.raises(UserError, match="reward raised on every one of 2 completions"):
        score(Picky("zero"), "picky", ["boom", "boom boom"], EXAMPLES[:2])


def test_wrong_number_of_scores_and_unknown_policy_are_user_errors():
    class Short(Picky):
        def reward(self, completions, examples):
            return Rewards(total=[1.0], components={"x": [1.0, 2.0]})

    with pytest.raises(UserError, match=r"task `short`: reward returned the wrong number of scores for 2 "
                                        r"completions: total has 1\."):
        score(Short(), "short", ["a", "b"], EXAMPLES[:2])
    with pytest.raises(UserError, match="reward_errors must be `raise` or `zero`, got `skip`"):
        score(Picky("skip"), "picky", ["a"], EXAMPLES[:1])


# --- through a training step -----------------------------------------------------------------------------------


@dataclass
class FlakyConfig:
    fail_on: str = "1"  # the answer of the question whose completions make reward raise


class Flaky:
    """Toy questions (reward = length / 100) whose reward raises for one question's completions."""

    def __init__(self, cfg: FlakyConfig) -> None:
        self.cfg = cfg

    def load(self, split):
        return [{"question": f"Count to {i}.", "answer": str(i)} for i in range(2)]

    def prompt(self, example):
        return [{"role": "user", "content": example["question"]}]

    def reward(self, completions, examples):
        if any(e["answer"] == self.cfg.fail_on for e in examples):
            raise KeyError("no such unit")
        lengths = [len(c) / 100 for c in completions]
        return Rewards(total=lengths, components={"length": lengths})

    def grade(self, completions, examples):
        return []

    def close(self):
        pass


class LenientFlaky(Flaky):
    reward_errors = "zero"


@pytest.fixture
def flaky_tasks(monkeypatch):
    """The two tasks registered for this test only (contract tests over the registry never see them)."""
    registry.load_builtins()
    monkeypatch.setattr(registry, "_entries", {kind: dict(entries) for kind, entries in registry._entries.items()})
    # names of their own: the plug-in tests/plugins/gpo_flaky.py registers `flaky` when an earlier test loads it
    registry.register("task", "raising_reward", config=FlakyConfig)(Flaky)
    registry.register("task", "lenient_reward", config=FlakyConfig)(LenientFlaky)


def test_engine_step_stops_or_counts_by_the_tasks_choice(flaky_tasks, tiny_model_path, tmp_path):
    from gpo.engine import Engine

    def engine(task):
        return Engine(compose([
            f"model={tiny_model_path}", f"output_dir={tmp_path}", "tracker=none", f"task={task}", "algo=grpo",
            "pruner=none", "allocator=static", "train.questions_per_step=2", "train.group_size=4",
            "train.max_completion_length=4", "train.micro_batch_size=8", "eval.before_and_after=false",
        ]))

    raised = r"task `raising_reward`: reward raised KeyError: 'no such unit' at .*in reward"
    with pytest.raises(UserError, match=raised):
        engine("raising_reward").step()
    lenient = engine("lenient_reward")
    for _ in range(2):  # the run goes on
        metrics = lenient.step()
        assert metrics["reward/errors"] == 4.0  # the 4 completions of question "1" scored 0, the other 4 normally
        assert math.isfinite(metrics["loss/total"])
