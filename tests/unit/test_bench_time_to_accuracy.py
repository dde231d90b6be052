"""The verdicts of bench/time_to_accuracy.py, on hand-made curves: when GRPO has levelled off, the time ratio to
GRPO's final accuracy, and the targets' met/missed lines. The benchmark's readings rest on these, and a run of it
takes hours, so its arithmetic is checked here on values worked out by hand."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture()
def tta(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its sibling as `harness`
    return importlib.import_module("time_to_accuracy")


def arm(curve, tokens=100.0, useful=10.0):
    return {"curve": curve, "tokens": tokens, "useful": useful, "steps": 1}


# second half (t >= 125 s): 0.65, 0.675, 0.65 at 150, 200, 250 s, a least-squares slope of 0
PLATEAU = [(0, 0.0), (50, 0.5), (100, 0.4), (150, 0.65), (200, 0.675), (250, 0.65)]
# second half: 0.4, 0.5, 0.65 at 150, 200, 250 s; slope 12.5 / 5000 = 0.0025 per s, so it rises 0.25 across the
# half, above one mark's noise at 40 questions: sqrt(0.5167 * 0.4833 / 40) = 0.079
RISING = [(0, 0.0), (50, 0.2), (100, 0.3), (150, 0.4), (200, 0.5), (250, 0.65)]


def test_a_flat_second_half_has_levelled_off_and_a_rising_one_has_not(tta):
    assert tta.levelled_off(PLATEAU, questions=40)
    assert not tta.levelled_off(RISING, questions=40)


def test_a_curve_that_peaked_and_fell_back_has_levelled_off(tta):
    assert tta.levelled_off([(0, 0.0), (100, 0.5), (150, 0.7), (200, 0.6), (250, 0.5)], questions=40)


def test_the_noise_allowance_shrinks_with_more_questions(tta):
    # second half 0.60, 0.63, 0.66 at 150, 200, 250 s: it rises 0.06, inside one mark's noise at 40 questions
    # (sqrt(0.63 * 0.37 / 40) = 0.076) and outside it at 1,000 (0.015)
    curve = [(0, 0.0), (100, 0.5), (150, 0.60), (200, 0.63), (250, 0.66)]
    assert tta.levelled_off(curve, questions=40)
    assert not tta.levelled_off(curve, questions=1000)


def test_too_few_late_marks_cannot_show_a_plateau(tta):
    assert not tta.levelled_off([(0, 0.0), (100, 0.6), (200, 0.6)], questions=40)


def test_grpo_levelled_names_the_seeds_and_says_when_the_budget_is_short(tta):
    results = {1: {"grpo": arm(PLATEAU)}, 2: {"grpo": arm(RISING)}}
    (line,) = tta.grpo_levelled(results, questions=40)
    assert "in 1 of 2 seeds: [1]" in line and "too short" in line
    (line,) = tta.grpo_levelled({1: {"grpo": arm(PLATEAU)}}, questions=40)
    assert "in 1 of 1 seeds: [1]" in line and "too short" not in line


def test_time_ratio_counts_from_grpos_first_mark_at_its_final_accuracy(tta):
    # GRPO's final accuracy is 0.65, which it first reached at 150 s (it peaked and fell back to it); the arm gets
    # to 0.65 at 60 s: 0.40x. Its tokens per useful row are 50 / 10 = 5 against GRPO's 100 / 10 = 10: 0.50x.
    fast = arm([(0, 0.0), (60, 0.7), (120, 0.7), (180, 0.75)], tokens=50.0)
    rows, summary = tta.summarise({1: {"grpo": arm(PLATEAU), "screen+cppo": fast}}, ["grpo", "screen+cppo"])
    got = summary["screen+cppo"]
    assert got["times"] == [pytest.approx(0.4)]
    assert got["finals"] == [pytest.approx(0.1)]
    assert got["per_row"] == [pytest.approx(0.5)]
    assert rows[0][1] == "1.00"  # GRPO against itself
    (line,) = tta.verdict(summary)
    assert line.endswith("target met")


def test_an_arm_that_never_reaches_the_target_misses_it(tta):
    slow = arm([(0, 0.0), (100, 0.3), (250, 0.5)])
    _, summary = tta.summarise({1: {"grpo": arm(PLATEAU), "screen+cppo": slow}}, ["grpo", "screen+cppo"])
    assert summary["screen+cppo"]["times"] == [None]
    assert tta._spread(summary["screen+cppo"]["times"]) == "not reached"
    (line,) = tta.verdict(summary)
    assert line.startswith("screen+cppo: time not reached (target <= 0.5)")
    assert line.endswith("target MISSED")


def test_the_first_mark_bounds_the_time_ratio_it_can_show(tta):
    # GRPO first reaches its final 0.65 at 150 s; with the first mark at 50 s no arm can read below 50 / 150 = 0.33.
    # The fast arm is at 0.7 already at its first mark; the slow one is not.
    fast = arm([(0, 0.0), (60, 0.7), (180, 0.75)])
    slow = arm([(0, 0.0), (60, 0.3), (180, 0.7)])
    (line,) = tta.mark_resolution({1: {"grpo": arm(PLATEAU), "screen": fast, "cppo": slow}}, first_mark=50.0)
    assert "(50 s) over GRPO's time to its final accuracy: 0.33;" in line
    assert line.endswith("already there at their first mark: screen in 1 of 1 seeds")


def test_saved_files_of_both_formats_load(tta, tmp_path):
    seeds = json.loads(json.dumps({"1": {"grpo": arm(PLATEAU)}}))  # as JSON holds it: the curve's pairs as lists
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(seeds))
    new.write_text(json.dumps({"settings": {"budget": 240}, "seeds": seeds}))
    assert tta.load_saved(old) == (None, {1: seeds["1"]})
    assert tta.load_saved(new) == ({"budget": 240}, {1: seeds["1"]})


def test_the_cosine_learning_rate_falls_by_time_from_the_peak_to_zero(tta):
    # 0.5 * (1 + cos(pi * t / budget)): 1 at the start, 1/2 at mid-budget, (1 + cos(pi/4)) / 2 = 0.8536 a quarter in,
    # 0 at the end and after it (the step that crosses the end)
    assert tta.lr_at(0.0, 240, 4e-5, "cosine") == pytest.approx(4e-5)
    assert tta.lr_at(60.0, 240, 4e-5, "cosine") == pytest.approx(4e-5 * 0.853553)
    assert tta.lr_at(120.0, 240, 4e-5, "cosine") == pytest.approx(2e-5)
    assert tta.lr_at(240.0, 240, 4e-5, "cosine") == pytest.approx(0.0, abs=1e-20)
    assert tta.lr_at(250.0, 240, 4e-5, "cosine") == pytest.approx(0.0, abs=1e-20)
    assert tta.lr_at(200.0, 240, 4e-5, "constant") == 4e-5


def test_the_per_row_floor_is_grpos_useful_share(tta):
    # seed 1: 832 useful rows of 79 steps x 2 questions x 8 = 1264 completions (a file saved before "completions"):
    # 0.66; seed 2: 400 of 1000 counted completions: 0.40, so the target is within reach there
    grpo_1 = {**arm(PLATEAU, useful=832.0), "steps": 79}
    grpo_2 = {**arm(PLATEAU, useful=400.0), "steps": 70, "completions": 1000.0}
    (line,) = tta.per_row_floor({1: {"grpo": grpo_1}}, questions=2)
    assert "in 0.66 of the completions" in line and "4x it for a CPPO arm" in line
    assert line.endswith("(it did in no seed)")
    (line,) = tta.per_row_floor({1: {"grpo": grpo_1}, 2: {"grpo": grpo_2}}, questions=2)
    assert "in 0.66, 0.40 of the completions" in line and line.endswith("(it did in some seeds)")


def test_a_constant_rate_run_keeps_the_settings_its_files_were_saved_with(tta):
    # files saved before --schedule ran at a constant rate and carry no "schedule" key; they still resume
    args = SimpleNamespace(model="m", budget=240.0, arms=["grpo"], pool=64, questions=2, max_new=32, lr=2e-5,
                           eval_limit=50, eval_at=[1.0], max_steps=10, set=[], schedule="constant")
    assert "schedule" not in tta.settings(args)
    args.schedule = "cosine"
    assert tta.settings(args)["schedule"] == "cosine"


class FakeEngine:
    """Steps of a fixed length, an accuracy that counts its evaluations, and the optimizer surface set_lr writes."""

    def __init__(self, step_seconds):
        self.step_seconds = step_seconds
        self.scheduler = SimpleNamespace(base_lrs=[0.0])
        self.optimizer = SimpleNamespace(param_groups=[{"lr": 0.0}])
        self.lrs, self.evaluations = [], 0

    def step(self):
        self.lrs.append(self.optimizer.param_groups[0]["lr"])
        return {"time/step": self.step_seconds, "tokens/generated": 100.0, "reward/mean": 0.5,
                "select/completions": 16.0, "select/useful_rows": 8.0}

    def evaluate(self, name):
        self.evaluations += 1
        return {f"eval/{name}/accuracy": self.evaluations / 10}


def test_a_step_that_passes_several_marks_is_evaluated_once_and_the_rate_anneals_by_time(tta, monkeypatch):
    # 50 s steps, budget 240 s, marks at 12, 24, 48, 120 and 240 s: the first step (to 50 s) passes three marks and
    # is evaluated once, the third (150 s) passes 120 s, the fifth (250 s) the end; the weights were the same at
    # the three marks of the first step, so three evaluations would have put three equal points in the
    # levelled-off regression. Each step runs at the cosine rate of the time it starts: 0, 50, 100, 150, 200 s.
    fake = FakeEngine(step_seconds=50.0)
    monkeypatch.setattr(tta, "engine", lambda *overrides: fake)
    args = SimpleNamespace(model="m", pool=64, max_steps=100, questions=2, max_new=32, lr=4e-5, eval_limit=50, set=[],
                           arms=["grpo"], budget=240.0, eval_at=[0.05, 0.1, 0.2, 0.5, 1.0], schedule="cosine")
    state = tta.run_seed(args, seed=1)["grpo"]
    assert state["curve"] == [(0.0, 0.1), (50.0, 0.2), (150.0, 0.3), (250.0, 0.4)]
    assert (state["steps"], state["seconds"], state["completions"], state["useful"]) == (5, 250.0, 80.0, 40.0)
    # 4e-5 * (1 + cos(pi * t / 240)) / 2: cos(pi * 50 / 240) = 0.793353, cos(pi * 100 / 240) = 0.258819
    assert fake.lrs[:3] == [pytest.approx(4e-5), pytest.approx(3.586707e-5), pytest.approx(2.517638e-5)]
    assert fake.lrs == sorted(fake.lrs, reverse=True) and fake.lrs[-1] > 0


def test_the_per_seed_table_shows_each_arms_tokens_per_completion(tta):
    # 1500 tokens over 100 completions = 15.0; 96 questions considered from a pool of 64 = 1.50 passes; a file saved
    # before completions were counted shows "-" rather than failing
    results = {1: {"grpo": {"steps": 3, "considered": 96.0, "tokens": 1500.0, "completions": 100.0,
                            "curve": [(0.0, 0.0), (50.4, 0.25)]},
                   "cppo": {"steps": 2, "tokens": 900.0, "curve": [(0.0, 0.0)]}}}
    assert tta.curve_rows(results, pool=64) == [[1, "grpo", 3, "1.50", "15.0", "0s:0.000 50s:0.250"],
                                                [1, "cppo", 2, "-", "-", "0s:0.000"]]
