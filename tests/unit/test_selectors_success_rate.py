"""Selectors judge a question by its success rate, as their papers define the rules, on GSM8K/MATH-shaped rewards
(total = 1.0 * format + 1.0 * accuracy) and arith-shaped ones (total = 0.1 * format + 1.0 * accuracy); `dapo`'s
group filter, `screen`, `greso` and `mopps` agree on what all right and all wrong mean; and every selector's state
survives the checkpoint's JSON round trip."""

from __future__ import annotations

import json

import pytest
import torch

from gpo import registry
from gpo.types import QuestionRewards

registry.load_builtins()

GSM8K, ARITH = 1.0, 0.1  # format weights (accuracy weighs 1.0 in both; MATH weighs like GSM8K)


def build(name: str, **cfg):
    return registry.get("selector", name).build(cfg)


def record(accuracy: list[int], formatted: list[int], format_weight: float = GSM8K) -> QuestionRewards:
    """One question's completions: the task's total is format_weight * format + accuracy, the pass criterion its
    accuracy."""
    acc, fmt = torch.tensor(accuracy, dtype=torch.float32), torch.tensor(formatted, dtype=torch.float32)
    return QuestionRewards(total=format_weight * fmt + acc, passed=acc, components={"accuracy": acc, "format": fmt})


def without_criterion(r: QuestionRewards) -> QuestionRewards:
    """The same totals from a task that reports no pass criterion."""
    return QuestionRewards(total=r.total, passed=None)


EMPTY = QuestionRewards(total=torch.zeros(0), passed=torch.zeros(0))  # a candidate the selector skipped

# 3 right (formatted), 3 wrong but formatted, 2 wrong and unformatted: GSM8K totals 2, 2, 2, 1, 1, 1, 0, 0
THREE_OF_EIGHT = ([1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0])
FOUR_OF_EIGHT = ([1, 1, 1, 1, 0, 0, 0, 0], [1] * 8)  # every answer formatted: totals 2 x4, 1 x4


# --- mopps: Beta(alpha + successes, beta + failures), successes counted on pass/fail -----------------------------

@pytest.mark.parametrize("rows, beta", [(THREE_OF_EIGHT, (4.0, 6.0)), (FOUR_OF_EIGHT, (5.0, 5.0))])
@pytest.mark.parametrize("weight", [GSM8K, ARITH])
def test_mopps_posterior_counts_right_answers_not_formatted_ones(rows, beta, weight):
    mopps = build("mopps")  # prior Beta(1, 1)
    mopps.observe([3], [record(*rows, format_weight=weight)], step=0)
    assert mopps.posterior[3] == beta  # 3 of 8: (1 + 3, 1 + 5); 4 of 8: (1 + 4, 1 + 4)


def test_mopps_on_the_total_counts_formatted_wrong_answers_as_successes():
    """judge_on=total reads GSM8K's totals >= 0.5 as right: a formatted wrong answer (total 1.0) counts, which is
    why the pass criterion is the default. On arith (format 0.1) the two readings agree."""
    mopps = build("mopps", judge_on="total")
    mopps.observe([1, 2, 3], [record(*THREE_OF_EIGHT), record(*FOUR_OF_EIGHT),
                              record(*THREE_OF_EIGHT, format_weight=ARITH)], step=0)
    assert mopps.posterior == {1: (7.0, 3.0), 2: (9.0, 1.0), 3: (4.0, 6.0)}


def test_mopps_falls_back_to_the_total_without_a_pass_criterion_and_ignores_skipped_candidates():
    mopps = build("mopps")
    mopps.observe([1, 2], [without_criterion(record(*THREE_OF_EIGHT)), EMPTY], step=0)
    assert mopps.posterior == {1: (7.0, 3.0)}  # totals 2, 2, 2, 1, 1, 1 are >= 0.5; question 2: no evidence


# --- greso: zero variance is all-pass (easy) or all-fail (hard) ---------------------------------------------------

@pytest.mark.parametrize("weight", [GSM8K, ARITH])
def test_greso_formatted_wrong_answers_are_a_hard_streak(weight):
    greso = build("greso")
    wrong = record([0] * 8, [1] * 8, format_weight=weight)  # GSM8K totals all 1.0: equal, and >= 0.5
    greso.observe([5], [wrong], step=0)
    assert greso.streaks[5] == ("hard", 1)
    # Formatting that differs among wrong answers is no signal either: still all-fail, the streak grows.
    greso.observe([5], [record([0] * 8, [1, 0] * 4, format_weight=weight)], step=1)
    assert greso.streaks[5] == ("hard", 2)
    greso.observe([5], [record([1] * 8, [1, 0] * 4, format_weight=weight)], step=2)
    assert greso.streaks[5] == ("easy", 1)  # all right, whatever the formatting
    greso.observe([5], [record([1, 0] * 4, [1] * 8, format_weight=weight)], step=3)
    assert 5 not in greso.streaks  # mixed: the streak ends


def test_greso_on_the_total_reads_formatted_wrong_answers_as_easy():
    greso = build("greso", judge_on="total")
    greso.observe([5], [record([0] * 8, [1] * 8)], step=0)
    assert greso.streaks[5] == ("easy", 1)  # the behaviour judge_on=accuracy exists to avoid


def test_greso_moves_p_down_when_a_share_equals_its_target_exactly():
    """Targets (released code): easy 0.25 * 1/3 = 1/12, hard 0.25 * 2/3 = 1/6. In floating point 0.25 * (1 - 1/3)
    is just above 1/6, so a float comparison would call a share of exactly 1/6 "below" and raise p_hard."""
    assert 1 / 6 < 0.25 * (1 - 1 / 3)  # the trap this test is about
    mixed = record([1, 0, 1, 0], [1, 1, 1, 1])
    hard = build("greso")
    hard.observe(list(range(6)), [record([0] * 4, [1, 0, 1, 1])] + [mixed] * 5, step=0)  # hard share 1/6
    assert hard.p == {"easy": pytest.approx(0.51), "hard": pytest.approx(0.49)}  # easy 0 < 1/12: up
    easy = build("greso")
    easy.observe(list(range(12)), [record([1] * 4, [1, 0, 0, 1])] + [mixed] * 11, step=0)  # easy share 1/12
    assert easy.p["easy"] == pytest.approx(0.49)
    below = build("greso")
    below.observe(list(range(7)), [record([0] * 4, [1] * 4)] + [mixed] * 6, step=0)  # hard share 1/7 < 1/6
    assert below.p["hard"] == pytest.approx(0.51)


def test_greso_share_counts_only_generated_candidates():
    greso = build("greso")
    # 1 hard of 6 generated (1/6: at target, p_hard down); the 6 skipped ones would make it 1/12 (below: up)
    greso.observe(list(range(12)), [record([0] * 4, [1] * 4)] + [record([1, 0, 1, 0], [1] * 4)] * 5 + [EMPTY] * 6,
                  step=0)
    assert greso.p["hard"] == pytest.approx(0.49) and set(greso.streaks) == {0}


# --- screen: continue only a screening success rate strictly between 0 and 1 --------------------------------------

@pytest.mark.parametrize("weight", [GSM8K, ARITH])
def test_screen_drops_all_wrong_and_all_right_whatever_the_formatting(weight):
    screen = build("screen", n_screen=4)
    rows = [record([0] * 4, [1, 0, 1, 0], weight),  # all wrong, formatting differs: totals differ
            record([1] * 4, [1, 1, 0, 1], weight),  # all right, formatting differs
            record([0, 1, 0, 0], [1] * 4, weight),  # success rate 1/4
            record([1, 1, 1, 0], [0, 1, 1, 0], weight),  # success rate 3/4
            record([0] * 4, [1] * 4, weight)]  # all wrong, equal totals
    assert screen.continue_after(list(range(5)), rows, 8) == [False, False, True, True, False]
    screen.observe(list(range(5)), rows, step=0)
    assert screen.expected_pass_rate() == 2 / 5 and screen.metrics() == {"select/pass_rate": 2 / 5}


def test_screen_on_the_total_continues_groups_whose_formatting_differs():
    screen = build("screen", n_screen=4, judge_on="total")
    rows = [record([0] * 4, [1, 0, 1, 0]), record([1] * 4, [1, 1, 0, 1]), record([0] * 4, [1] * 4)]
    assert screen.continue_after([0, 1, 2], rows, 8) == [True, True, False]


# --- dapo, screen, greso and mopps agree on all right and all wrong -----------------------------------------------

# (accuracy, formatted, what the group is): G = 4, each under both format weights
TABLE = [
    ([1, 1, 1, 1], [1, 1, 1, 1], "all right"),
    ([1, 1, 1, 1], [1, 0, 1, 0], "all right"),
    ([1, 1, 1, 1], [0, 0, 0, 0], "all right"),
    ([0, 0, 0, 0], [1, 1, 1, 1], "all wrong"),
    ([0, 0, 0, 0], [0, 1, 1, 1], "all wrong"),
    ([0, 0, 0, 0], [0, 0, 0, 0], "all wrong"),
    ([1, 0, 0, 0], [1, 1, 1, 1], "mixed"),
    ([0, 1, 1, 1], [0, 1, 1, 1], "mixed"),
    ([1, 0, 1, 0], [0, 1, 0, 1], "mixed"),  # GSM8K totals all 1.0: equal totals, yet mixed
]


@pytest.mark.parametrize("weight", [GSM8K, ARITH])
def test_dapo_screen_greso_and_mopps_classify_every_group_alike(weight):
    rows = [record(acc, fmt, weight) for acc, fmt, _ in TABLE]
    expected = [kind for _, _, kind in TABLE]
    questions = list(range(len(rows)))
    dapo = registry.get("algo", "dapo").build(None, max_completion_length=64)
    components = {k: torch.stack([r.components[k] for r in rows]) for k in ("accuracy", "format")}  # [B, G]
    kept = dapo.group_filter(torch.stack([r.total for r in rows]), components).tolist()
    continued = build("screen", n_screen=2).continue_after(questions, rows, 8)
    greso = build("greso")
    greso.observe(questions, rows, step=0)
    streak = {"easy": "all right", "hard": "all wrong"}
    mopps = build("mopps")
    mopps.observe(questions, rows, step=0)
    successes = [round(mopps.posterior[q][0] - 1) for q in questions]  # alpha - prior
    by_dapo = ["mixed" if k else "flat" for k in kept]
    by_screen = ["mixed" if c else "flat" for c in continued]
    by_greso = [streak[greso.streaks[q][0]] if q in greso.streaks else "mixed" for q in questions]
    by_mopps = ["all right" if s == 4 else "all wrong" if s == 0 else "mixed" for s in successes]
    flat = ["mixed" if e == "mixed" else "flat" for e in expected]
    assert by_dapo == flat and by_screen == flat
    assert by_greso == expected and by_mopps == expected


# --- selector state is JSON (the checkpoint) and decides the same after a round trip ------------------------------

@pytest.mark.parametrize("name", registry.names("selector"))
def test_selector_state_survives_a_json_round_trip_and_decides_the_same(name):
    G, questions = 8, [4, 0, 9, 2, 7, 5]
    history = [record([1] * 8, [1] * 8), record([0] * 8, [1] * 8), record([1, 0] * 4, [1] * 8),
               record([1, 1, 0, 1] * 2, [1, 0] * 4), EMPTY, record([0, 1] * 4, [0] * 8)]
    original = build(name)
    for step in range(3):
        original.first_phase(questions, G, seed=step)
        original.continue_after(questions, [QuestionRewards(r.total[:2], r.passed[:2]) for r in history], G)
        original.observe(questions, history, step=step)
    reloaded = build(name)
    reloaded.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert reloaded.expected_pass_rate() == original.expected_pass_rate()
    assert reloaded.metrics() == original.metrics()
    for seed in (11, 12):
        assert reloaded.first_phase(questions, G, seed=seed) == original.first_phase(questions, G, seed=seed)
    screening = [QuestionRewards(r.total[:4], r.passed[:4]) for r in history]
    assert reloaded.continue_after(questions, screening, G) == original.continue_after(questions, screening, G)
    for s in (original, reloaded):
        s.observe(questions, history, step=3)
    assert reloaded.state_dict() == original.state_dict()
