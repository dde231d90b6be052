"""Selectors' rules on hand-made rewards (SPEED-RL screening, GRESO skipping, MoPPS Thompson selection), the pure
phase plumbing of gpo/rollout_phases.py, and the sampler's finite pools."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from gpo import registry
from gpo.errors import UserError
from gpo.metrics import selection_metrics
from gpo.ops import no_variance
from gpo.rollout_phases import (
    CONTINUATION_SEED,
    PROMPT_SEEDS,
    Call,
    Round,
    RoundLedger,
    generation_seed,
    ledger,
    no_rows,
    phase_calls,
    rank_share,
    rewards_by_question,
    split_call,
    whole_groups,
)
from gpo.sampler import QuestionStream
from gpo.selectors.mopps import beta_sample
from gpo.types import QuestionRewards, RolloutBatch

registry.load_builtins()


def build(name: str, **cfg):
    return registry.get("selector", name).build(cfg)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def r(*totals: float) -> QuestionRewards:
    """A question's rewards with no pass criterion: the selectors judge its totals (selection/base.py)."""
    return QuestionRewards(total=t(*totals), passed=None)


# --- no variance ---------------------------------------------------------------------------------------------------

def test_no_variance_is_equal_rewards_within_the_tolerance():
    assert no_variance(t(1, 1, 1, 1), 1e-6) and no_variance(t(0, 0), 1e-6) and no_variance(t(0.5), 1e-6)
    assert not no_variance(t(0, 1, 0, 0), 1e-6)
    assert no_variance(t(1.0, 1.05, 1.1), 0.1 + 1e-6) and not no_variance(t(1.0, 1.05, 1.1), 0.05)


# --- none and screen -----------------------------------------------------------------------------------------------

def test_none_gives_every_candidate_its_whole_group():
    assert build("none").first_phase([5, 2, 9], 8, seed=0) == [8, 8, 8]
    assert build("none").expected_pass_rate() == 1.0


def test_screen_continues_only_questions_with_unequal_screening_rewards():
    screen = build("screen", n_screen=4)
    assert screen.first_phase([0, 1, 2, 3], 8, seed=0) == [4, 4, 4, 4]
    rewards = [r(1, 1, 1, 1), r(0, 0, 0, 0), r(0, 1, 0, 0), r(1.1, 1.0, 1.1, 1.1)]
    assert screen.continue_after([0, 1, 2, 3], rewards, 8) == [False, False, True, True]
    assert screen.expected_pass_rate() is None  # nothing folded in before observe
    screen.observe([0, 1, 2, 3], rewards, step=0)
    assert screen.expected_pass_rate() == 0.5  # 2 of 4 continued
    state = screen.state_dict()
    again = build("screen", n_screen=4)
    again.load_state_dict(state)
    assert again.expected_pass_rate() == 0.5


def test_screen_estimate_has_a_floor_and_a_screen_of_g_is_the_whole_group():
    screen = build("screen", n_screen=2)
    screen.continue_after(list(range(16)), [r(0, 0)] * 16, 4)
    screen.observe(list(range(16)), [r(0, 0)] * 16, step=0)
    assert screen.expected_pass_rate() == 0.125  # 0 of 16 continued: floored, so a step stays bounded
    assert build("screen", n_screen=8).first_phase([1, 2], 8, seed=0) == [8, 8]


@pytest.mark.parametrize("cfg", [{"n_screen": 1}, {"tolerance": -1.0}])
def test_screen_rejects_bad_settings(cfg):
    with pytest.raises(UserError):
        build("screen", **cfg)


# --- greso ---------------------------------------------------------------------------------------------------------

def test_greso_draw_probability_is_p_to_the_streak_floored_by_p_min():
    greso = build("greso", p_min=0.1)
    greso.observe([0, 1, 2], [r(1, 1, 1, 1), r(0, 0, 0, 0), r(0, 1, 1, 0)], step=0)
    # After this round: 1 easy and 1 hard zero-variance group of 3 = 1/3 each, above the targets 0.25/3 and
    # 0.25*2/3, so both p move down one step from 0.5.
    assert greso.p == {"easy": pytest.approx(0.49), "hard": pytest.approx(0.49)}
    assert greso.draw_probability(0) == pytest.approx(0.49) and greso.draw_probability(1) == pytest.approx(0.49)
    assert greso.draw_probability(2) == 1.0  # mixed: no streak
    for _ in range(3):
        greso.observe([1], [r(0, 0, 0, 0)], step=1)
    # hard p: 0.49 -> 0.46 after three all-hard rounds (each 100% > target); streak 4
    assert greso.streaks[1] == ("hard", 4)
    assert greso.draw_probability(1) == pytest.approx(max(0.46**4, 0.1))
    greso.observe([1], [r(0, 1, 0, 0)], step=2)
    assert 1 not in greso.streaks and greso.draw_probability(1) == 1.0


def test_greso_p_rises_when_zero_variance_is_below_target_and_stays_in_bounds():
    greso = build("greso", p_start=0.95)
    greso.observe([0, 1], [r(0, 1, 0, 1), r(1, 0, 0, 0)], step=0)
    assert greso.p == {"easy": 0.95, "hard": 0.95}  # would rise, held at p_high
    greso = build("greso", p_start=0.05, p_low=0.05)
    greso.observe([0], [r(1, 1)], step=0)
    assert greso.p["easy"] == 0.05


def test_greso_easy_streak_restarts_when_the_kind_changes():
    greso = build("greso")
    greso.observe([3], [r(1, 1, 1)], step=0)
    greso.observe([3], [r(1, 1, 1)], step=1)
    assert greso.streaks[3] == ("easy", 2)
    greso.observe([3], [r(0, 0, 0)], step=2)
    assert greso.streaks[3] == ("hard", 1)


def test_greso_skips_by_a_seeded_draw_identically_for_equal_state():
    first, second = build("greso"), build("greso")
    for g in (first, second):
        g.observe(list(range(20)), [r(0, 0, 0, 0)] * 20, step=0)
    counts = first.first_phase(list(range(20)), 4, seed=123)
    assert counts == second.first_phase(list(range(20)), 4, seed=123)
    # Each draw against p_hard = 0.49 (streak 1): the same uniforms torch gives for seed 123.
    u = torch.rand(20, generator=torch.Generator().manual_seed(123))
    assert counts == [4 if x < 0.49 else 0 for x in u.tolist()]
    assert first.expected_pass_rate() == max(sum(c > 0 for c in counts) / 20, 0.125)
    restored = build("greso")
    restored.load_state_dict(first.state_dict())
    assert restored.streaks == first.streaks and restored.p == first.p


# --- mopps ---------------------------------------------------------------------------------------------------------

def test_mopps_posterior_counts_successes_and_failures():
    mopps = build("mopps")
    mopps.observe([7, 8], [r(1, 1, 0, 1), r(0, 0, 0, 0)], step=0)
    assert mopps.posterior == {7: (4.0, 2.0), 8: (1.0, 5.0)}
    decayed = build("mopps", decay=0.5)
    decayed.observe([7], [r(1, 1)], step=0)
    decayed.observe([7], [r(0, 0)], step=1)
    # (1,1) -> (3,1) -> alpha 0.5*3 + 0.5*1 + 0 = 2, beta 0.5*1 + 0.5*1 + 2 = 3
    assert decayed.posterior[7] == (2.0, 3.0)


def test_mopps_keeps_the_candidates_whose_thompson_sample_is_nearest_the_target():
    mopps = build("mopps", keep_fraction=0.5)
    mopps.observe([0, 1, 2, 3], [r(*[1] * 30), r(*[0] * 30), r(*[1, 0] * 15), r(*[1, 0] * 15)], step=0)
    counts = mopps.first_phase([0, 1, 2, 3], 4, seed=5)
    assert counts == [0, 0, 4, 4]  # the two near 0.5, not the solved or the hopeless one
    alpha = torch.tensor([31.0, 1.0, 16.0, 16.0], dtype=torch.float64)
    beta = torch.tensor([1.0, 31.0, 16.0, 16.0], dtype=torch.float64)
    np.testing.assert_array_equal(beta_sample(alpha, beta, 5).numpy(),
                                  np.random.default_rng(5).beta(alpha.numpy(), beta.numpy()))
    assert mopps.expected_pass_rate() == 0.5


def test_mopps_band_keeps_every_sample_inside():
    mopps = build("mopps", band=[0.3, 0.7])
    mopps.observe([0, 1, 2], [r(*[1] * 40), r(*[1, 0] * 20), r(*[0] * 40)], step=0)
    assert mopps.first_phase([0, 1, 2], 4, seed=0) == [0, 4, 0]
    assert mopps.expected_pass_rate() == pytest.approx(1 / 3)


@pytest.mark.parametrize("cfg", [{"keep_fraction": 0.0}, {"band": [0.7, 0.3]}, {"decay": 0.0}, {"prior_alpha": 0}])
def test_mopps_rejects_bad_settings(cfg):
    with pytest.raises(UserError):
        build("mopps", **cfg)


def test_greso_rejects_p_bounds_out_of_order():
    with pytest.raises(UserError, match="p_low <= p_start <= p_high"):
        build("greso", p_low=0.6, p_start=0.5)  # each in (0, 1]; the order of the three is the constructor's check


@pytest.mark.parametrize(
    "name, fields, field",
    [
        ("screen", {"n_screen": 1}, "n_screen"),  # one completion has no variance to screen on
        ("screen", {"tolerance": -1e-3}, "tolerance"),
        ("greso", {"p_low": 0.0}, "p_low"),  # p^z with p = 0 would never draw a question again
        ("greso", {"p_high": 1.5}, "p_high"),
        ("greso", {"target": 1.1}, "target"),
        ("greso", {"easy_share": -0.1}, "easy_share"),
        ("greso", {"p_min": 2.0}, "p_min"),
        ("greso", {"adjust_step": -0.01}, "adjust_step"),
        ("mopps", {"keep_fraction": 0.0}, "keep_fraction"),
        ("mopps", {"band": [0.3, 1.2]}, "band"),
        ("mopps", {"band": [0.3]}, "band"),  # [low, high]: two ends
        ("mopps", {"prior_alpha": 0.0}, "prior_alpha"),
        ("mopps", {"decay": 0.0}, "decay"),
        ("mopps", {"target": -0.5}, "target"),
    ],
)
def test_config_types_reject_out_of_range_values(name, fields, field):
    with pytest.raises(ValidationError) as err:
        TypeAdapter(registry.get("selector", name).config).validate_python(fields)
    assert err.value.errors()[0]["loc"][0] == field


def test_mopps_band_from_a_yaml_list_is_a_pair():
    cfg = TypeAdapter(registry.get("selector", "mopps").config).validate_python({"band": [0.3, 0.7]})
    assert cfg.band == (0.3, 0.7)
    assert build("mopps", band=[0.3, 0.7]).cfg.band == (0.3, 0.7)


# --- phases --------------------------------------------------------------------------------------------------------

def positions(call):
    return [i for _, i in call.entries]


def test_phase_calls_group_equal_counts_and_skip_zeros():
    calls = phase_calls([([4, 0, 2, 4, 2], 100)], group_size=4)
    assert [(positions(c), c.counts, c.seed) for c in calls] == [([2, 4], [2, 2], 100), ([0, 3], [4, 4], 102)]
    assert [(positions(c), c.counts, c.seed) for c in phase_calls([([4, 4, 4], 7)], 4)] == [([0, 1, 2], [4] * 3, 7)]
    assert phase_calls([([0, 0], 1)], 4) == []
    with pytest.raises(UserError):
        phase_calls([([5], 1)], 4)


def test_two_rounds_phases_share_calls():
    # G = 8: round A continues candidates 0 and 2 with 6 more (screened with 2), round B screens 3 candidates with 2
    asks = [([6, 0, 6], 50), ([2, 2, 2], 90)]
    (mixed,) = phase_calls(asks, 8, mixed=True)  # a backend that takes a count per prompt: one call, A's first
    assert mixed.entries == [(0, 0), (0, 2), (1, 0), (1, 1), (1, 2)] and mixed.counts == [6, 6, 2, 2, 2]
    assert mixed.seed == 50 and not mixed.uniform
    by_count = phase_calls(asks, 8)  # one count per call: equal counts still share, across rounds
    assert [(c.entries, c.counts, c.seed) for c in by_count] == [
        ([(1, 0), (1, 1), (1, 2)], [2, 2, 2], 50), ([(0, 0), (0, 2)], [6, 6], 53)]
    (same,) = phase_calls([([4, 0, 4], 50), ([4, 4], 90)], 8)  # G = 2 * n_screen: one call either way
    assert same.entries == [(0, 0), (0, 2), (1, 0), (1, 1)] and same.uniform


def test_split_call_hands_each_round_its_rows_with_candidate_positions():
    first, second = (Round(pool=[10, 11, 12], examples=[], counts=[2, 2, 2], seed=0) for _ in range(2))
    call = Call(entries=[(0, 2), (1, 0), (1, 1)], counts=[3, 1, 2], seed=0)
    ids = torch.arange(6).unsqueeze(1)  # row r's single token is r
    batch = RolloutBatch(prompt_ids=ids, prompt_mask=torch.ones_like(ids), completion_ids=ids,
                         completion_mask=torch.ones_like(ids), group_ids=torch.zeros(6, dtype=torch.long),
                         rewards=torch.arange(6.0), advantages=torch.zeros(6),
                         truncated=torch.zeros(6, dtype=torch.bool), owner_rank=torch.zeros(6, dtype=torch.long))
    split_call([first, second], call, batch)
    ((rows_a, q_a),) = first.rows
    ((rows_b, q_b),) = second.rows
    assert rows_a.rewards.tolist() == [0, 1, 2] and q_a.tolist() == [2, 2, 2]
    assert rows_b.rewards.tolist() == [3, 4, 5] and q_b.tolist() == [0, 1, 1]
    first.more = [0, 2, 2]
    assert first.screened(4) == [0, 1, 2] and first.continued == 2


def test_rank_share_splits_contiguously_and_covers_every_prompt():
    assert [rank_share(6, r, 2) for r in (0, 1)] == [slice(0, 3), slice(3, 6)]
    shares = [rank_share(5, r, 2) for r in (0, 1)]
    assert shares == [slice(0, 2), slice(2, 5)]


def test_whole_groups_orders_rows_by_question_and_drops_screened_out():
    # phase 1: questions 0, 1, 2 screened with 2 rows each; phase 2: questions 0 and 2 continued with 2 more
    question = torch.tensor([0, 0, 1, 1, 2, 2, 0, 0, 2, 2])
    rows = whole_groups(question, group_size=4)
    assert rows.tolist() == [0, 1, 6, 7, 4, 5, 8, 9]  # question 1 (2 rows) is screened out
    rows = no_rows()
    rows.rewards = torch.arange(10.0)
    rows.reward_components = {"format": torch.ones(10), "accuracy": torch.arange(10.0) % 2}
    per_question = rewards_by_question(rows, question, 4)
    assert [r.total.tolist() for r in per_question] == [[0, 1, 6, 7], [2, 3], [4, 5, 8, 9], []]
    assert [r.passed.tolist() for r in per_question] == [[0, 1, 0, 1], [0, 1], [0, 1, 0, 1], []]
    assert [len(r) for r in per_question] == [4, 2, 4, 0]
    assert per_question[0].components["format"].tolist() == [1, 1, 1, 1]
    assert rewards_by_question(rows, question, 4, pass_key="missing")[0].passed is None


def test_ledger_and_selection_metrics_by_hand():
    # 4 candidates, G = 4: one skipped, three screened with 2; one continued (2 more).
    rewards = [QuestionRewards(total=r, passed=r) for r in (t(), t(0, 0), t(1, 0, 1, 1), t(1, 1))]
    spent = ledger([0, 2, 2, 2], continued=1, rewards=rewards, tokens=80, group_size=4)
    assert spent == RoundLedger(considered=4, skipped=1, screened=3, screened_out=2, completions=8, tokens=80,
                                generated_questions=3, zero_var_generated=2, groups=1, zero_var_groups=0)
    m = selection_metrics(spent.add(RoundLedger()), group_size=4, useful_rows=4)
    assert m["select/completions_baseline"] == 16 and m["select/completions_frac"] == 0.5
    assert m["select/tokens_saved_est"] == (16 - 8) * 10  # 8 missing completions at the mean length 80/8
    assert m["select/zero_var_before"] == pytest.approx(2 / 3) and m["select/zero_var_after"] == 0.0
    assert m["tokens/generated"] == 80 and m["tokens/generated_per_useful_row"] == 20
    assert "tokens/generated_per_useful_row" not in selection_metrics(spent, 4, useful_rows=0)


# --- finite pools --------------------------------------------------------------------------------------------------

def test_a_finite_pool_comes_back_once_per_epoch_in_a_new_seeded_order():
    stream = QuestionStream([{"i": i} for i in range(5)], seed=3)
    epochs = [stream.take_indices(5) for _ in range(3)]
    assert all(sorted(e) == list(range(5)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled
    resumed = QuestionStream([{"i": i} for i in range(5)], seed=3)
    resumed.load_state_dict({"epoch": 1, "position": 2})
    assert resumed.take_indices(3) == epochs[1][2:]
    stream.load_state_dict({"epoch": 0, "position": 0})
    assert stream.take(2) == [{"i": i} for i in epochs[0][:2]]


def test_arith_trains_on_a_fixed_pool_of_train_size_questions():
    arith = registry.get("task", "arith").build({"train_size": 8, "digits": 2})
    pool = arith.load("train")
    assert len(pool) == 8
    stream = QuestionStream(pool, seed=0)
    two_epochs = stream.take(16)
    assert sorted(e["question"] for e in two_epochs[:8]) == sorted(e["question"] for e in pool)
    assert sorted(e["question"] for e in two_epochs[8:]) == sorted(e["question"] for e in pool)
    with pytest.raises(UserError, match="train_size"):
        registry.get("task", "arith").build({"train_size": 0})


def test_study_table_sums_selection_over_steps():
    from gpo.study.tables import _selection_columns
    from gpo.tracking_store import RunRecord

    def steps(*values):
        return [(i + 1, float(v)) for i, v in enumerate(values)]

    history = {"select/considered": steps(8, 8), "select/skipped": steps(2, 0), "select/screened_out": steps(1, 3),
               "select/completions": steps(30, 40), "select/completions_baseline": steps(64, 64),
               "select/useful_rows": steps(10, 6), "tokens/generated": steps(300, 500)}
    record = RunRecord(run_id="r", name="r", combination="", group="g", status="FINISHED", error="", baseline=False,
                       metrics={}, history=history, params={})
    assert _selection_columns(record) == {"questions_dropped_frac": 6 / 16, "completions_frac": 70 / 128,
                                          "tokens_per_useful_row": 800 / 16}
    plain = RunRecord(run_id="p", name="p", combination="", group="g", status="FINISHED", error="", baseline=False,
                      metrics={}, history={}, params={})
    assert set(_selection_columns(plain).values()) == {None}


def test_no_two_calls_of_a_run_share_a_seed():
    """Every call's prompts take seeds seed .. seed + prompts - 1. Over 300 steps of 16 rounds with both phases, at
    the most prompts a call may have, no two calls' seed ranges meet (spaced 31 apart, as before, round 0's prompt
    31 had round 1's prompt 0's seed)."""
    ranges = []
    for step in range(300):
        for r in range(16):
            first = generation_seed(5, step, r)
            second = first + CONTINUATION_SEED
            ranges += [(first, first + PROMPT_SEEDS), (second, second + PROMPT_SEEDS)]
    ranges.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:], strict=False))
    assert generation_seed(5, 0, 1) != generation_seed(5, 0, 0) + 31
    assert generation_seed(5, 7, 2) == generation_seed(5, 7, 2)  # a function of (run seed, step, round) only
