"""`gpo.step_math.select`: a selector's phases on scripted rewards, through the same code as the engine's rollout
(gpo.rollout_phases.advance), on GSM8K/MATH-shaped rewards (format weight 1.0) and arith-shaped ones (0.1)."""

from __future__ import annotations

import pytest

from gpo import registry
from gpo.step_math import select

registry.load_builtins()
G = 4


def build(name: str, **cfg):
    return registry.get("selector", name).build(cfg or None)


def shaped(accuracy: list[int], formats: list[int], weight: float) -> dict[str, list[float]]:
    """A task's rewards: total = weight * format + accuracy, as gsm8k/math (weight 1.0) and arith (0.1) ship."""
    return {"total": [weight * f + a for a, f in zip(accuracy, formats, strict=True)],
            "accuracy": [float(a) for a in accuracy], "format": [float(f) for f in formats]}


@pytest.mark.parametrize("weight", [1.0, 0.1])
def test_screen_trains_only_mixed_questions_and_counts_what_it_generated(weight):
    rewards = {
        10: shaped([0, 0, 1, 0], [1, 0, 1, 1], weight),  # screening rows 0, 0 wrong (formats differ): dropped
        11: shaped([1, 0, 1, 1], [1, 1, 1, 1], weight),  # screening 1, 0: mixed, continued to G
        12: shaped([1, 1, 0, 0], [0, 1, 1, 1], weight),  # screening 1, 1 right (formats differ): dropped
    }
    run = select(build("screen", n_screen=2), rewards, group_size=G)
    assert run.trained == [11]
    assert run.screened_out == [10, 12] and run.skipped == []
    assert run.generated == {10: 2, 11: 4, 12: 2}
    assert run.ledger.considered == 3 and run.ledger.screened == 3 and run.ledger.screened_out == 2
    assert run.ledger.completions == 8 and run.ledger.groups == 1


def test_gsm8k_accuracy_values_pass_by_their_sign():
    """GSM8K's accuracy is 2 for the exact answer and 1.5 for an equal number: a screening pair of one of each is
    all right (dropped), and MoPPS counts both as successes."""
    gsm8k = {"total": [3.0, 2.5, 0.0, 1.0], "accuracy": [2.0, 1.5, 0.0, 0.0], "format": [1.0, 1.0, 0.0, 1.0]}
    run = select(build("screen", n_screen=2), {3: gsm8k}, group_size=G)
    assert run.screened_out == [3] and run.trained == []
    mopps = build("mopps")
    select(mopps, {3: gsm8k}, group_size=G)
    assert [round(v, 6) for v in mopps.posterior[3]] == [3.0, 3.0]  # Beta(1 + 2, 1 + 2)


def test_screen_judging_on_the_total_continues_a_wrong_group_whose_formatting_differs():
    rewards = {10: shaped([0, 0, 0, 0], [1, 0, 1, 1], 1.0)}
    assert select(build("screen", n_screen=2, judge_on="total"), rewards, group_size=G).trained == [10]
    assert select(build("screen", n_screen=2), rewards, group_size=G).trained == []


def test_mopps_posterior_after_a_harness_round_counts_right_answers():
    """3 right of 4 (all formatted, total 2 or 1): Beta(1 + 3, 1 + 1) on the success rate; on the total every
    completion would look like a success."""
    mopps = build("mopps")
    run = select(mopps, {5: shaped([1, 1, 0, 1], [1, 1, 1, 1], 1.0)}, group_size=G)
    assert run.generated == {5: 4}
    assert [round(v, 6) for v in mopps.posterior[5]] == [4.0, 2.0]


def test_without_selection_every_question_gets_its_group_and_zero_variance_is_counted():
    none = build("none")
    run = select(none, {1: shaped([1, 0, 1, 0], [1, 1, 1, 1], 1.0), 2: shaped([0, 0, 0, 0], [1, 1, 1, 1], 1.0)},
                 group_size=G)
    assert run.skipped == [] and run.trained == [1, 2] and run.generated == {1: 4, 2: 4}
    assert run.ledger.zero_var_groups == 1  # question 2: all wrong, all formatted


def test_too_few_scripted_rewards_is_an_error():
    with pytest.raises(ValueError, match="fewer than"):
        select(build("none"), {1: shaped([1, 0], [1, 1], 1.0)}, group_size=G)
