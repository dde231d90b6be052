"""`gpo study` and `gpo report`: grid planning (no model) and the table's arithmetic on a hand-made MLflow store (a
real study on the tiny model: tests/integration/test_study_grid.py)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import yaml

from gpo.errors import UserError
from gpo.study import TAG_BASELINE, TAG_COMBINATION, TAG_ERROR, plan, report, split_values
from kit import assert_png

PLUGINS = Path(__file__).parents[1] / "plugins"
sys.path.insert(0, str(PLUGINS))
TOY = ["task=toy", "plugins=[gpo_toy]"]


# --- planning: no model, no training -----------------------------------------------------------------------------


def test_values_split_on_top_level_commas_only():
    assert split_values("0.5,0.75,0.875") == ["0.5", "0.75", "0.875"]
    assert split_values("[a,b],[c]") == ["[a,b]", "[c]"]
    assert split_values("{x: 1, y: 2}") == ["{x: 1, y: 2}"]
    assert split_values("'a,b',c") == ["'a,b'", "c"]


def test_grid_is_the_product_with_inapplicable_overrides_dropped_and_duplicates_merged():
    p = plan(["algo=grpo,dapo", "pruner=none,topk", "pruner.rate=0.5,0.75", *TOY])
    assert [r.combination for r in p.runs] == [
        "algo=grpo pruner=none", "algo=grpo pruner=topk pruner.rate=0.5", "algo=grpo pruner=topk pruner.rate=0.75",
        "algo=dapo pruner=none", "algo=dapo pruner=topk pruner.rate=0.5", "algo=dapo pruner=topk pruner.rate=0.75",
    ]
    assert [r.index for r in p.runs] == [1, 2, 3, 4, 5, 6]
    assert [getattr(r.cfg.pruner.config, "rate", None) for r in p.runs] == [None, 0.5, 0.75, None, 0.5, 0.75]
    assert [r.cfg.algo.name for r in p.runs] == ["grpo"] * 3 + ["dapo"] * 3
    assert p.baseline == 0
    assert any("`pruner.rate` does not apply to pruner `none`" in n for n in p.notes)
    assert sum("resolves to the same config as" in n for n in p.notes) == 2
    # plugins=[gpo_toy] has no top-level comma: a fixed value, not an axis
    assert all(r.cfg.task.name == "toy" for r in p.runs)


def test_a_component_setting_that_only_its_value_makes_valid_is_kept():
    """topk's default rate 0.75 keeps no completion of a group of 2, so topk is valid here only with
    `pruner.rate=0.5`: telling which component a combination picks must not check the defaults without it."""
    p = plan(["pruner=none,topk", "pruner.rate=0.5", "train.group_size=2", *TOY])
    assert [(r.cfg.pruner.name, getattr(r.cfg.pruner.config, "rate", None)) for r in p.runs] == [
        ("none", None), ("topk", 0.5)]


def test_the_staleness_bound_is_an_axis_and_its_refusals_reach_the_plan():
    p = plan(["train.max_staleness=0,1,2,4", *TOY])
    assert [r.combination for r in p.runs] == [f"train.max_staleness={k}" for k in (0, 1, 2, 4)]
    assert [r.cfg.train.max_staleness for r in p.runs] == [0, 1, 2, 4]
    with pytest.raises(UserError, match="a generator running ahead trains under plain DDP or on one process"):
        plan(["train.max_staleness=0,1", "engine=zero2", *TOY])


def test_a_fixed_component_override_applies_where_it_exists():
    p = plan(["pruner=none,topk", "pruner.rate=0.5", *TOY])
    assert [(r.combination, getattr(r.cfg.pruner.config, "rate", None)) for r in p.runs] == [("pruner=none", None),
                                                                            ("pruner=topk", 0.5)]


def test_baseline_is_chosen_by_its_settings():
    p = plan(["algo=grpo,dapo", "pruner=none,topk", *TOY], baseline="algo=dapo pruner=none")
    assert p.runs[p.baseline].combination == "algo=dapo pruner=none"
    p = plan(["pruner=topk", "pruner.rate=0.5,0.75", *TOY], baseline="pruner.rate=0.750")  # numbers compare as numbers
    assert p.runs[p.baseline].combination == "pruner.rate=0.75"
    with pytest.raises(UserError, match="matches no run"):
        plan(["pruner=none,topk", *TOY], baseline="pruner=random")
    with pytest.raises(UserError, match="by its settings"):
        plan(["pruner=none,topk", *TOY], baseline="topk")


@pytest.mark.parametrize("args,message", [
    (["pruner=none,topk", "pruner.ratee=0.5,0.7"], r"`pruner.ratee` is not a field of pruner `none` or `topk`\. "
                                                   r"Did you mean `pruner.rate`\?"),
    (["output_dir=a,b"], "cannot be a grid axis"),
    (["tracker.experiment=a,b"], "cannot be a grid axis"),
    (["optim.lr=1e-5,"], "empty value"),
    (["optim.lrr=1e-5,1e-6"], "unknown key `optim.lrr`"),
    (["experiment=smoke,cppo_gsm8k"], "experiment cannot be a grid axis"),
    (["experiment=smoek"], "unknown experiment `smoek`.*Did you mean `smoke`"),
    (["pruner.rate=0.5", "pruner.rate=0.5,0.7"], "given twice"),
])
def test_bad_grids_are_user_errors(args, message):
    with pytest.raises(UserError, match=message):
        plan(args)


def test_a_config_file_carries_a_grid_and_a_baseline_and_the_command_line_wins(tmp_path):
    f = tmp_path / "grid.yaml"
    f.write_text(yaml.safe_dump({
        "defaults": {"algo": "grpo"},
        "train": {"steps": 3},
        "pruner": {"rate": 0.875},  # a file's component keys are dropped where they do not apply, too
        "grid": {"pruner": ["none", "topk"], "optim": {"lr": [1e-5, 1e-6]}},
        "baseline": {"pruner": "topk", "optim.lr": 1e-6},
    }, sort_keys=False))
    p = plan([*TOY], [f])
    assert [r.combination for r in p.runs] == ["pruner=none optim.lr=1e-05", "pruner=none optim.lr=1e-06",
                                               "pruner=topk optim.lr=1e-05", "pruner=topk optim.lr=1e-06"]
    assert [r.cfg.optim.lr for r in p.runs] == [1e-5, 1e-6, 1e-5, 1e-6]
    assert [getattr(r.cfg.pruner.config, "rate", None) for r in p.runs] == [None, None, 0.875, 0.875]
    assert all(r.cfg.train.steps == 3 for r in p.runs)
    assert p.runs[p.baseline].combination == "pruner=topk optim.lr=1e-06"
    assert any("`pruner.rate` does not apply to pruner `none`" in n for n in p.notes)
    # A command-line value replaces the file's axis; --baseline replaces the file's baseline.
    p = plan(["optim.lr=3e-6", *TOY], [f], baseline="pruner=none")
    assert [r.combination for r in p.runs] == ["pruner=none", "pruner=topk"]
    assert p.baseline == 0 and all(r.cfg.optim.lr == 3e-6 for r in p.runs)


def test_an_experiment_is_a_layer_under_the_grid():
    p = plan(["experiment=smoke", "pruner=none,topk", *TOY])
    assert [r.combination for r in p.runs] == ["pruner=none", "pruner=topk"]
    assert all(r.cfg.train.steps == 2 and r.cfg.train.group_size == 4 for r in p.runs)  # smoke's values


def test_a_single_run_refuses_a_study_file(tmp_path):
    from gpo.config import compose

    f = tmp_path / "grid.yaml"
    f.write_text(yaml.safe_dump({"grid": {"pruner": ["none", "topk"]}}))
    with pytest.raises(UserError, match="`grid` is read by `gpo study`"):
        compose([], [f])


@pytest.mark.parametrize("grid,message", [
    ([1, 2], "must be a mapping"),
    ({"pruner.rate": 0.5}, "non-empty list"),
    ({"pruner.rate": []}, "non-empty list"),
    ({"pruner": [1, 2]}, "values must be names"),
])
def test_a_bad_grid_in_a_file_is_a_user_error(tmp_path, grid, message):
    f = tmp_path / "grid.yaml"
    f.write_text(yaml.safe_dump({"grid": grid}))
    with pytest.raises(UserError, match=message):
        plan(TOY, [f])


# --- the table, from a hand-made MLflow store -------------------------------------------------------------------


def _fake_run(client, experiment_id, name, combination, status, steps, *, baseline=False, error="", summary=None):
    tags = {TAG_COMBINATION: combination}
    if baseline:
        tags[TAG_BASELINE] = "true"
    if error:
        tags[TAG_ERROR] = error
    run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
    for step, metrics in enumerate(steps, start=1):
        for key, value in metrics.items():
            client.log_metric(run_id, key, value, step=step)
    for key, value in (summary or {}).items():
        client.log_metric(run_id, key, value, step=len(steps))
    client.set_terminated(run_id, status)
    return run_id


def test_report_table_arithmetic_on_known_runs(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("gpo", artifact_location=(tmp_path / "art").as_uri())

    def step(reward, seconds, generated, trained, kept, **task):
        return {"reward/mean": reward, "time/step": seconds, "tokens/generated": generated, "tokens/trained": trained,
                "prune/kept_frac": kept, **{f"reward/{k}": v for k, v in task.items()}}

    # a logs the task's success rate and reward apart from its shaped one; b, an older run, only its accuracy mean
    slow = _fake_run(client, exp, "a", "pruner=none", "FINISHED",
                     [step(0.1, 3.0, 100, 100, 1.0, success_rate=0.25, task_mean=0.5, accuracy_mean=0.25),
                      step(-0.5, 5.0, 120, 120, 1.0, success_rate=0.375, task_mean=0.625, accuracy_mean=0.375)],
                     summary={"eval/before/accuracy": 0.25, "eval/after/accuracy": 0.5, "final/reward_mean": 0.2,
                              "train/seconds": 11.0, "study/peak_rss_mb": 900.0})
    fast = _fake_run(client, exp, "b", "pruner=topk", "FINISHED", [step(0.3, 1.0, 200, 50, 0.25, accuracy_mean=0.5),
                                                                   step(0.4, 1.0, 220, 60, 0.5, accuracy_mean=0.75)],
                     baseline=True, summary={"eval/after/accuracy": 0.75, "final/reward_mean": 0.4})
    broken = _fake_run(client, exp, "c", "pruner=topk pruner.rate=1.5", "FAILED", [],
                       error="UserError: pruning rate P must be in [0, 1), got 1.5")

    report([slow, fast, broken], tracking_uri=str(tmp_path), out_dir=tmp_path / "out")  # a directory as the store
    rows = list(csv.DictReader(open(tmp_path / "out" / "study.csv")))
    a, b, c = rows
    assert [r["run_id"] for r in rows] == [slow, fast, broken]
    assert float(a["train_s"]) == 8.0 and float(b["train_s"]) == 2.0
    assert float(a["speedup"]) == pytest.approx(2.0 / 8.0)  # the tagged baseline is b, not the first run
    assert float(b["speedup"]) == 1.0
    assert float(a["tokens_generated"]) == 220 and float(b["tokens_trained"]) == 110
    assert float(b["kept_frac"]) == pytest.approx(0.375)
    assert (a["acc_before"], a["acc_after"], b["acc_before"], b["acc_after"]) == ("0.25", "0.5", "", "0.75")
    # the last step's task measures, never the shaped reward/mean (-0.5) or final/reward_mean (0.2)
    assert "final_reward" not in a and float(a["peak_rss_mb"]) == 900.0
    assert (float(a["final_success_rate"]), float(a["final_task_reward"])) == (0.375, 0.625)
    assert float(b["final_success_rate"]) == 0.75 and b["final_task_reward"] == ""  # success rate read as accuracy_mean
    assert float(a["wall_s"]) == 11.0 and b["wall_s"] == ""
    assert c["status"] == "FAILED" and c["error"].startswith("UserError: pruning rate")
    assert c["speedup"] == c["train_s"] == ""
    md = (tmp_path / "out" / "study.md").read_text()
    assert "| 2 | pruner=topk | pruner=topk |  | yes | FINISHED |" in md and "1.00x" in md
    assert "Baseline for speed-ups: `pruner=topk`" in md
    assert "final_success_rate: the last step's success rate (`reward/success_rate`" in md
    assert "not compared on the shaped reward (`reward/mean`)" in md
    # b logged no reward/success_rate or reward/task_mean per step: the curve falls back to reward/mean and says so
    assert "reward_vs_time.png shows `reward/mean` against training time: shaped reward" in md
    assert "Combinations over seeds" not in md and not (tmp_path / "out" / "groups.csv").exists()  # no replicates

    with pytest.raises(UserError, match="no MLflow run `nope`"):
        report(["nope"], tracking_uri=uri, out_dir=tmp_path / "x")
    with pytest.raises(UserError, match="no MLflow store"):
        report([slow], tracking_uri=str(tmp_path / "missing"), out_dir=tmp_path / "x")


def _record(group: str, history: dict):
    from gpo.tracking_store import RunRecord

    return RunRecord(run_id=group, name=group, combination=group, group=group, status="FINISHED", error="",
                     baseline=False, metrics={}, history=history, params={})


def test_the_time_curve_shows_the_task_measure_every_run_logged(tmp_path):
    """GRPO and DAPO runs: DAPO's shaped reward/mean sits below GRPO's whatever its success rate, so the curve shows
    the success rate while every trained run has it, else the task reward, and the shaped reward only as a last
    resort."""
    from gpo.study import plots

    times = [(1, 2.0), (2, 3.0)]
    grpo = _record("algo=grpo", {"time/step": times, "reward/mean": [(1, 0.2), (2, 0.3)],
                                 "reward/success_rate": [(1, 0.25), (2, 0.5)],
                                 "reward/task_mean": [(1, 0.3), (2, 0.6)]})
    dapo = _record("algo=dapo", {"time/step": times, "reward/mean": [(1, -0.5), (2, -0.4)],
                                 "reward/success_rate": [(1, 0.125), (2, 0.625)],
                                 "reward/task_mean": [(1, 0.2), (2, 0.7)]})
    failed = _record("algo=dapo seed=2", {})  # never trained a step: has no say
    assert plots.curve_metric([grpo, dapo, failed]) == "reward/success_rate"
    assert plots._curve(dapo, "reward/success_rate") == {1: (2.0, 0.125), 2: (5.0, 0.625)}  # seconds summed over steps
    assert_png(plots.reward_vs_time([grpo, dapo, failed], tmp_path / "curve.png"))
    del dapo.history["reward/success_rate"]
    assert plots.curve_metric([grpo, dapo]) == "reward/task_mean"
    del dapo.history["reward/task_mean"]
    assert plots.curve_metric([grpo, dapo]) == "reward/mean"
