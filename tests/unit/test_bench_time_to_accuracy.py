"""The verdicts of bench/time_to_accuracy.py, on hand-made curves: when GRPO has levelled off, the time ratio to
GRPO's final accuracy, accuracy at equal time, passes over the pool, the targets' met/missed lines, extra arms from
the command line and resuming a saved run. The benchmark's readings rest on these, and a run of it
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


def arm(curve, tokens=100.0, useful=10.0, considered=64.0, pool=64):
    return {"curve": curve, "tokens": tokens, "useful": useful, "steps": 1, "considered": considered,
            "seconds": curve[-1][0], "pool": pool}


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
    rows, summary = tta.summarise({1: {"grpo": arm(PLATEAU), "screen+cppo": fast}}, ["grpo", "screen+cppo"], 250)
    got = summary["screen+cppo"]
    assert got["times"] == [pytest.approx(0.4)]
    assert got["finals"] == [pytest.approx(0.1)]
    assert got["per_row"] == [pytest.approx(0.5)]
    assert rows[0][1] == "1.00"  # GRPO against itself
    best, line = tta.verdict(summary)
    # 0.40x misses the 0.33x target; a final 0.1 above GRPO's meets its own
    assert best == ("Best arm screen+cppo: time to GRPO's final accuracy 0.40x GRPO's at the median (missed: target "
                    "<= 0.33x), final accuracy +0.100 vs GRPO at the median (met: target >= 0): targets MISSED")
    assert line.startswith("screen+cppo: time 0.40x GRPO's (missed), final accuracy +0.100 vs GRPO (met)")
    assert line.endswith("tokens per useful row 0.50x GRPO's (met: target <= 0.5x)")
    # equal time over 250 s, trapezoids of 50 s between GRPO's marks: 50 x (0.25 + 0.45 + 0.525 + 0.6625 + 0.6625)
    # = 127.5, / 250 = 0.51; the arm's: 60 x (0.35 + 0.7 + 0.725) = 106.5, then 0.75 held for 70 s = 52.5, so
    # 159 / 250 = 0.636, 0.126 above. Means over the marks: (0.7 + 0.7 + 0.75) / 3 = 0.7167 against 2.875 / 5 = 0.575
    assert got["area"] == [pytest.approx(0.636)] and got["areas"] == [pytest.approx(0.126)]
    assert got["means"] == [pytest.approx(0.141667, abs=1e-6)]


def test_an_arm_that_never_reaches_the_target_misses_it(tta):
    slow = arm([(0, 0.0), (100, 0.3), (250, 0.5)])
    _, summary = tta.summarise({1: {"grpo": arm(PLATEAU), "screen+cppo": slow}}, ["grpo", "screen+cppo"], 250)
    assert summary["screen+cppo"]["times"] == [None]
    assert tta._spread(summary["screen+cppo"]["times"]) == "not reached"
    best, line = tta.verdict(summary)
    assert best.startswith("Best arm screen+cppo: time to GRPO's final accuracy not reached at the median (missed")
    assert best.endswith("final accuracy -0.150 vs GRPO at the median (missed: target >= 0): targets MISSED")
    assert line.startswith("screen+cppo: time not reached (missed)")


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
    args = SimpleNamespace(model="m", budget=240.0, pool=64, questions=2, max_new=32, lr=2e-5, rate=4.0,
                           eval_limit=50, eval_at=[1.0], max_steps=10, set=[], schedule="constant")
    old = {"model": "m", "budget": 240.0, "arms": ["grpo"], "pool": 64, "questions": 2, "max_new": 32, "lr": 2e-5,
           "eval_limit": 50, "eval_at": [1.0], "max_steps": 10, "set": []}
    assert tta.settings(args, {"grpo": tta.ARMS["grpo"]}) == old  # no rate, arm settings or schedule key
    args.schedule = "cosine"
    assert tta.settings(args, {"grpo": tta.ARMS["grpo"]})["schedule"] == "cosine"


def test_a_fresh_pool_and_extra_arms_are_part_of_the_settings(tta):
    args = SimpleNamespace(model="m", budget=240.0, pool="fresh", questions=2, max_new=32, lr=2e-5, rate=4.0,
                           eval_limit=50, eval_at=[1.0], max_steps=10, set=[], schedule="cosine")
    arms = {"grpo": tta.ARMS["grpo"], "p875": ["pruner=topk", "pruner.rate=0.875"]}
    got = tta.settings(args, arms)
    assert (got["rate"], got["arms"], got["arm_settings"]) == (4.0, ["grpo", "p875"], {"p875": arms["p875"]})


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
    args = SimpleNamespace(model="m", max_steps=100, questions=2, max_new=32, lr=4e-5, eval_limit=50, set=[],
                           budget=240.0, eval_at=[0.05, 0.1, 0.2, 0.5, 1.0], schedule="cosine")
    state = tta.run_seed(args, seed=1, arms={"grpo": tta.ARMS["grpo"]}, pool=64)["grpo"]
    assert state["curve"] == [(0.0, 0.1), (50.0, 0.2), (150.0, 0.3), (250.0, 0.4)]
    assert (state["steps"], state["seconds"], state["completions"], state["useful"]) == (5, 250.0, 80.0, 40.0)
    # 4e-5 * (1 + cos(pi * t / 240)) / 2: cos(pi * 50 / 240) = 0.793353, cos(pi * 100 / 240) = 0.258819
    assert fake.lrs[:3] == [pytest.approx(4e-5), pytest.approx(3.586707e-5), pytest.approx(2.517638e-5)]
    assert fake.lrs == sorted(fake.lrs, reverse=True) and fake.lrs[-1] > 0


def test_the_per_seed_table_shows_each_arms_tokens_per_completion(tta):
    # 1500 tokens over 100 completions = 15.0; 96 questions considered from a pool of 64 = 1.50 passes; a file saved
    # before completions were counted shows "-" rather than failing
    results = {1: {"grpo": {"steps": 3, "considered": 96.0, "tokens": 1500.0, "completions": 100.0,
                            "curve": [(0.0, 0.0), (50.4, 0.25)]},  # saved before arms recorded their pool
                   "cppo": {"steps": 2, "tokens": 900.0, "curve": [(0.0, 0.0)]}}}
    assert tta.curve_rows(results, pool=64) == [[1, "grpo", 3, "1.50", "15.0", "0s:0.000 50s:0.250"],
                                                [1, "cppo", 2, "-", "-", "0s:0.000"]]


def test_the_best_arm_is_the_fastest_and_meets_the_targets_at_a_third_of_grpos_time(tta):
    # GRPO first reaches its final 0.65 at 150 s: "quick" gets there at 45 s, 0.30x (<= 0.33), and ends at 0.75,
    # +0.1; "steady" gets there at 60 s, 0.40x. Tokens per useful row 100 / 10 against GRPO's: 1.00x, missed.
    quick = arm([(0, 0.0), (45, 0.7), (250, 0.75)])
    steady = arm([(0, 0.0), (60, 0.7), (250, 0.8)])
    _, summary = tta.summarise({1: {"grpo": arm(PLATEAU), "steady": steady, "quick": quick}},
                               ["grpo", "steady", "quick"], 250)
    best, *arms = tta.verdict(summary)
    assert best.startswith("Best arm quick: time to GRPO's final accuracy 0.30x GRPO's at the median (met")
    assert best.endswith("targets met")
    assert [line.split(":")[0] for line in arms] == ["steady", "quick"]
    assert arms[1].endswith("tokens per useful row 1.00x GRPO's (missed: target <= 0.5x)")


def test_the_median_and_range_over_seeds_of_the_new_columns(tta):
    # three seeds of GRPO on PLATEAU (area 0.51, see above) against an arm at a constant 0.4, 0.5 and 0.6 from its
    # first mark at 50 s: areas (50 x a / 2 + 200 x a) / 250 = 0.9 a = 0.36, 0.45, 0.54; 64, 128 and 160 questions
    # from a pool of 64: 1, 2 and 2.5 passes
    results = {seed: {"grpo": arm(PLATEAU), "flat": arm([(0, 0.0), (50, a), (250, a)], considered=drawn)}
               for seed, a, drawn in [(1, 0.4, 64.0), (2, 0.5, 128.0), (3, 0.6, 160.0)]}
    rows, _ = tta.summarise(results, ["grpo", "flat"], 250)
    assert dict(zip(tta.HEADERS, rows[1])) == {
        "arm": "flat", "time to GRPO's final accuracy / GRPO's time to it": "not reached (never-never)",
        "final accuracy": "0.50 (0.40-0.60)", "final accuracy - GRPO's": "-0.150 (-0.250--0.050)",
        "area under the curve / budget": "0.45 (0.36-0.54)", "area - GRPO's": "-0.060 (-0.150-+0.030)",
        "mean accuracy over the marks - GRPO's": "-0.075 (-0.175-+0.025)",
        "generated tokens per useful row / GRPO's": "1.00 (1.00-1.00)", "passes over the pool": "2.00 (1.00-2.50)"}


def test_the_area_under_the_curve_is_cut_at_the_budget_or_held_to_it(tta):
    # 0-100 s: 100 x (0 + 0.4) / 2 = 20; 100-200 s: 100 x (0.4 + 0.6) / 2 = 50; the last mark at 260 s is past the
    # 240 s budget: at 240 s the line is at 0.6 + 0.3 x 40 / 60 = 0.8, so 40 x (0.6 + 0.8) / 2 = 28; 98 / 240
    assert tta.area_under([(0, 0.0), (100, 0.4), (200, 0.6), (260, 0.9)], 240) == pytest.approx(98 / 240)
    # stopped at 100 s of a 200 s budget: 100 x (0.2 + 0.6) / 2 = 40, then 0.6 held for 100 s = 60; 100 / 200
    assert tta.area_under([(0, 0.2), (100, 0.6)], 200) == pytest.approx(0.5)
    assert tta.area_under([(0, 0.5), (240, 0.5)], 240) == pytest.approx(0.5)


def test_passes_are_questions_drawn_over_the_pool(tta):
    assert tta.pool_passes({"considered": 96.0, "pool": 64}) == 1.5
    assert tta.pool_passes({"considered": 96.0}, pool=32) == 3.0  # saved before arms recorded their pool
    assert tta.pool_passes({"steps": 3}, pool=64) != tta.pool_passes({"steps": 3}, pool=64)  # nan: no count saved
    old = {k: v for k, v in arm(PLATEAU, considered=64.0).items() if k != "pool"}
    assert tta.summarise({1: {"grpo": old}}, ["grpo"], 250, pool=32)[1]["grpo"]["passes"] == [2.0]


def test_a_fresh_pool_is_one_pass_at_the_rate_it_is_sized_for(tta):
    assert tta.fresh_pool(240, 4.0) == 960
    assert tta.fresh_pool(101, 2.5) == 253  # 252.5 rounded up
    assert tta.pool_size("fresh", 240, 4.0) == 960
    assert tta.pool_size(64, 240, 4.0) == 64


def test_the_pool_notes_flag_an_arm_that_ran_out_of_fresh_questions(tta):
    # "fast" drew 210 questions from a pool of 64 in 60 s: 3.28 passes, 3.5 questions/s
    results = {1: {"grpo": arm([(0, 0.0), (60, 0.5)], considered=32.0),
                   "fast": arm([(0, 0.0), (60, 0.5)], considered=210.0)}}
    (line,) = tta.pool_notes(results, fresh=True)
    assert line.startswith("Most passes over the pool in a seed: grpo 0.50, fast 3.28; fast made more than 2")
    assert line.endswith("too small for 3.50 questions/s (run again with --rate 3.5 or more)")
    results[1]["fast"]["considered"] = 100.0
    (line,) = tta.pool_notes(results, fresh=True)
    assert line.endswith("grpo 0.50, fast 1.56; no arm made more than 2, so none ran short of fresh questions")
    (line,) = tta.pool_notes(results, fresh=False)
    assert "a repeating pool" in line


def test_an_arm_from_the_command_line_takes_an_arms_settings_and_overrides(tta):
    name, overrides = tta.parse_arm("screen+cppo-p875=screen+cppo,pruner.rate=0.875", tta.ARMS)
    assert (name, overrides) == ("screen+cppo-p875", [*tta.ARMS["screen+cppo"], "pruner.rate=0.875"])
    # a comma inside brackets belongs to the value
    assert tta.parse_arm("ops=grpo,task.operators=[+,-]", tta.ARMS)[1] == [*tta.ARMS["grpo"], "task.operators=[+,-]"]
    arms = tta.arm_overrides(["grpo"], ["a=cppo,seed=3", "b=a,pruner.rate=0.5"])  # b builds on a
    assert arms == {"grpo": tta.ARMS["grpo"], "a": [*tta.CPPO, "seed=3"], "b": [*tta.CPPO, "seed=3", "pruner.rate=0.5"]}
    for bad, why in [("x=nosuch", "neither key=value nor an arm"), ("cppo=grpo", "already an arm"),
                     ("x", "expected NAME=ITEM")]:
        with pytest.raises(ValueError, match=why):
            tta.parse_arm(bad, tta.ARMS)


def test_history_based_arms_are_known_by_their_last_selector_pick(tta):
    assert tta.uses_history(tta.ARMS["mopps+cppo"]) and tta.uses_history(tta.ARMS["greso+cppo"])
    assert not tta.uses_history(tta.ARMS["screen+cppo"]) and not tta.uses_history(tta.ARMS["grpo"])
    assert not tta.uses_history(["selector=mopps", "selector=screen"])


def test_a_fresh_pool_run_refuses_history_based_arms_before_loading_anything(tta, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["time_to_accuracy.py", "--arms", "grpo", "mopps+cppo", "--no-write"])
    with pytest.raises(SystemExit) as exit_:
        tta.main()
    assert exit_.value.code == 2
    assert "mopps+cppo learn from questions that come back" in capsys.readouterr().err


def resume_args(path, seeds, budget=240.0):
    return SimpleNamespace(model="m", budget=budget, pool="fresh", rate=4.0, questions=2, max_new=32, lr=2e-5,
                           eval_limit=50, eval_at=[1.0], max_steps=10, set=[], schedule="cosine", seeds=seeds,
                           save=path)


def test_a_second_invocation_with_the_same_save_file_measures_only_the_missing_seeds(tta, tmp_path):
    ran = []

    def run(args, seed, arms, pool):
        ran.append(seed)
        return {"grpo": arm([(0, 0.0), (240, seed / 10)], pool=pool)}

    arms, path = {"grpo": tta.ARMS["grpo"]}, tmp_path / "run.json"
    first = tta.measure(resume_args(path, [1, 2]), arms, 960, run=run)
    assert ran == [1, 2] and sorted(first) == [1, 2]
    again = tta.measure(resume_args(path, [1, 2, 3]), arms, 960, run=run)
    assert ran == [1, 2, 3]  # 1 and 2 came from the file
    assert again[1]["grpo"]["curve"] == [[0, 0.0], [240, 0.1]] and again[3]["grpo"]["curve"] == [(0, 0.0), (240, 0.3)]
    assert sorted(tta.load_saved(path)[1]) == [1, 2, 3]
    assert sorted(tta.measure(resume_args(path, [2]), arms, 960, run=run)) == [2] and ran == [1, 2, 3]
    with pytest.raises(tta.OtherSettings, match="saved with other settings"):
        tta.measure(resume_args(path, [4], budget=480.0), arms, 1920, run=run)


def test_every_seed_is_saved_before_the_next_one_runs(tta, tmp_path):
    def run(args, seed, arms, pool):
        if seed == 2:
            raise RuntimeError("the machine went away")
        return {"grpo": arm([(0, 0.0), (240, 0.5)])}

    path = tmp_path / "run.json"
    with pytest.raises(RuntimeError):
        tta.measure(resume_args(path, [1, 2]), {"grpo": tta.ARMS["grpo"]}, 960, run=run)
    saved_settings, seeds = tta.load_saved(path)
    assert sorted(seeds) == [1] and saved_settings["rate"] == 4.0
