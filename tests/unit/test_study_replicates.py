"""Replicates in `gpo study`: seeds as a grid axis, t intervals (hand-derived values), pairing by seed, the plain
words of the groups table, and the pruning-rate table; all on hand-made MLflow runs (no model)."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest

from gpo.errors import UserError
from gpo.study import TAG_BASELINE, TAG_COMBINATION, TAG_GROUP, plan, report
from gpo.study.stats import Interval, difference_interval, mean_interval, paired, speedup_interval, verdict

sys.path.insert(0, str(Path(__file__).parents[1] / "plugins"))
TOY = ["task=toy", "plugins=[gpo_toy]"]
T_975 = {1: 12.706204736174698, 2: 4.302652729911275}  # Student's t, 97.5% quantile, by degrees of freedom (tables)


# --- intervals ----------------------------------------------------------------------------------------------------


def test_mean_interval_is_t_based():
    # 1, 2, 3: mean 2, sample sd 1, half-width t(2) * 1 / sqrt(3)
    iv = mean_interval([1.0, 2.0, 3.0])
    half = T_975[2] / math.sqrt(3)
    assert (iv.n, iv.centre) == (3, 2.0)
    assert iv.low == pytest.approx(2 - half) and iv.high == pytest.approx(2 + half)
    assert mean_interval([5.0]) == Interval(1, 5.0) and mean_interval([]) == Interval(0, None)


def test_speedup_is_paired_by_seed_on_the_log_scale():
    base = {"1": 10.0, "2": 12.0, "3": 16.0, "9": 99.0}  # seed 9 has no partner: left out
    other = {"1": 5.0, "2": 6.0, "3": 8.0 * 16 / 14, "4": 1.0}
    pairs = paired(base, other)
    assert [b for b, _ in pairs] == [10.0, 12.0, 16.0]
    # ratios 2, 2, 1.75 -> logs; interval = exp(mean(log) +- t(2) * sd(log) / sqrt(3))
    logs = [math.log(2), math.log(2), math.log(1.75)]
    m = sum(logs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    iv = speedup_interval(pairs)
    assert iv.centre == pytest.approx(math.exp(m))  # the geometric mean, 1.9129...
    assert iv.low == pytest.approx(math.exp(m - T_975[2] * sd / math.sqrt(3)))  # 1.5796...
    assert iv.high == pytest.approx(math.exp(m + T_975[2] * sd / math.sqrt(3)))  # 2.3166...
    assert verdict(iv, 1.0, "faster", "slower") == "faster"


def test_accuracy_difference_and_the_plain_words():
    pairs = [(0.5, 0.6), (0.6, 0.5), (0.4, 0.5)]  # differences +0.1, -0.1, +0.1
    iv = difference_interval(pairs)
    sd = math.sqrt(((0.1 - 1 / 30) ** 2 * 2 + (-0.1 - 1 / 30) ** 2) / 2)
    assert iv.centre == pytest.approx(1 / 30)
    assert iv.high - iv.centre == pytest.approx(T_975[2] * sd / math.sqrt(3))
    assert verdict(iv, 0.0, "higher", "lower") == "no difference shown (95% CI includes 0)"
    # -0.4, -0.3, -0.35: mean -0.35, sd 0.05, half-width 4.30 * 0.05 / sqrt(3) = 0.124: all below 0
    assert verdict(difference_interval([(0.5, 0.1), (0.5, 0.2), (0.5, 0.15)]), 0.0, "higher", "lower") == "lower"
    assert verdict(difference_interval([(0.5, 0.6)]), 0.0, "higher", "lower") == "one seed: no interval"
    # two seeds: t(1) = 12.71 makes the interval wide; a real but small difference is not shown
    iv = speedup_interval([(10.0, 5.0), (10.0, 6.0)])
    assert iv.low == pytest.approx(math.exp(math.log(10 / math.sqrt(30)) - T_975[1] * math.log(1.2) / 2))


# --- planning replicates ------------------------------------------------------------------------------------------


def test_seeds_are_the_replicate_axis():
    p = plan(["pruner=none,topk", "study.seeds=3", "seed=7", *TOY])
    # seed by seed, so every combination meets the machine's drift alike
    assert [(r.group, r.seed) for r in p.runs] == [("pruner=none", 7), ("pruner=topk", 7), ("pruner=none", 8),
                                                   ("pruner=topk", 8), ("pruner=none", 9), ("pruner=topk", 9)]
    assert [r.combination for r in p.runs][:2] == ["pruner=none seed=7", "pruner=topk seed=7"]
    assert [r.seed for r in p.baseline_runs()] == [7, 8, 9]
    p = plan(["pruner=none,topk", "seed=1,2", *TOY], baseline="pruner=topk")  # an explicit seed axis
    assert [(r.group, r.seed) for r in p.baseline_runs()] == [("pruner=topk", 1), ("pruner=topk", 2)]
    assert [r.seed for r in plan(["study.seeds=2", *TOY]).runs] == [42, 43]  # from the configured seed


@pytest.mark.parametrize("args,message", [
    (["seed=1,2", "study.seeds=2"], "either `seed=1,2,3` or `study.seeds=3`"),
    (["study.seeds=0"], "`study.seeds` must be >= 1"),
    (["study.seedz=2"], "unknown key `study.seedz`.*Did you mean `study.seeds`"),
    (["study.parallel=two"], "`study.parallel` has the wrong type"),
])
def test_bad_study_settings_are_user_errors(args, message):
    with pytest.raises(UserError, match=message):
        plan([*args, *TOY])


def test_a_single_run_refuses_study_settings(tmp_path):
    from gpo.config import compose

    f = tmp_path / "s.yaml"
    f.write_text("study:\n  seeds: 3\n")
    with pytest.raises(UserError, match="`study` is read by `gpo study`"):
        compose([], [f])
    p = plan(TOY, [f])  # ... which a study reads
    assert len(p.runs) == 3 and p.options.seeds == 3


# --- tables from hand-made runs -----------------------------------------------------------------------------------


def _run(client, exp, group, seed, times, acc, *, baseline=False, rate=None, status="FINISHED", kept=1.0,
         test_acc=None):
    tags = {TAG_COMBINATION: f"{group} seed={seed}", TAG_GROUP: group}
    if baseline:
        tags[TAG_BASELINE] = "true"
    run_id = client.create_run(exp, run_name=f"{group}-{seed}", tags=tags).info.run_id
    client.log_param(run_id, "seed", str(seed))
    client.log_param(run_id, "train.group_size", "8")
    client.log_param(run_id, "pruner.name", "none" if rate is None else "topk")
    client.log_param(run_id, "pruner.rate", str(rate))
    client.log_param(run_id, "eval.split", "validation")
    client.log_param(run_id, "task.name", "arith")
    for step, seconds in enumerate(times, start=1):
        for key, value in {"time/step": seconds, "reward/mean": 0.1 * step, "tokens/generated": 100.0,
                           "tokens/trained": 100.0 * kept, "prune/kept_frac": kept}.items():
            client.log_metric(run_id, key, value, step=step)
    client.log_metric(run_id, "eval/after/accuracy", acc, step=len(times))
    if test_acc is not None:  # eval.tasks=[arith] and eval.samples=2, as a run logs them
        client.log_metric(run_id, "eval/after/arith/accuracy", test_acc, step=len(times))
        client.log_metric(run_id, "eval/after/arith/pass_at_2", test_acc + 0.1, step=len(times))
    client.set_terminated(run_id, status)
    return run_id


def test_groups_table_pairs_by_seed_and_says_when_there_is_no_difference(tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("gpo", artifact_location=(tmp_path / "art").as_uri())
    ids = [_run(client, exp, "pruner=none", s, [t / 2, t / 2], a, baseline=True)
           for s, t, a in ((1, 10.0, 0.5), (2, 12.0, 0.6), (3, 16.0, 0.4))]
    ids += [_run(client, exp, "pruner=topk pruner.rate=0.75", s, [t], a, rate=0.75, kept=0.25, test_acc=a / 2)
            for s, t, a in ((1, 5.0, 0.6), (2, 6.0, 0.5), (3, 16 / 1.75, 0.5))]
    report(ids, tracking_uri=str(tmp_path), out_dir=tmp_path / "out")

    runs = list(csv.DictReader(open(tmp_path / "out" / "study.csv")))
    # each run's speed-up is against the baseline run of its own seed
    assert [float(r["speedup"]) for r in runs] == pytest.approx([1.0, 1.0, 1.0, 2.0, 2.0, 1.75])
    assert [r["baseline"] for r in runs] == ["yes"] * 3 + [""] * 3
    base, topk = list(csv.DictReader(open(tmp_path / "out" / "groups.csv")))
    assert (base["group"], base["runs"], base["faster"], base["accuracy"]) == ("pruner=none", "3/3", "baseline",
                                                                               "baseline")
    assert float(base["train_s"]) == pytest.approx(38 / 3)
    logs = [math.log(2), math.log(2), math.log(1.75)]
    assert float(topk["speedup"]) == pytest.approx(math.exp(sum(logs) / 3))
    assert topk["faster"] == "faster"
    assert float(topk["acc_diff"]) == pytest.approx(1 / 30)
    assert topk["accuracy"] == "no difference shown (95% CI includes 0)"
    md = (tmp_path / "out" / "study.md").read_text()
    assert "t-based" in md and "t=4.30 for n=3" in md and "no difference shown" in md
    assert "1.91x [1.58, 2.32]" in md  # the speed-up and its interval, as derived in the test above

    # two rates: the paper-style table, k kept of G from the measured kept fraction
    rates = list(csv.DictReader(open(tmp_path / "out" / "rates.csv")))
    assert [(r["rate"], r["kept"]) for r in rates] == [("0.0", "8 of 8"), ("0.75", "2 of 8")]
    assert float(rates[1]["tokens_trained"]) == 25.0
    # eval.tasks scored the run's own task: the rates table reports that test accuracy (blank where not logged)
    assert rates[0]["accuracy (arith test)"] == "" and float(rates[1]["accuracy (arith test)"]) == pytest.approx(
        (0.3 + 0.25 + 0.25) / 3)
    assert float(runs[3]["arith_pass_at_2"]) == pytest.approx(0.4) and runs[0]["arith_accuracy"] == ""
    assert (tmp_path / "out" / "rates.png").read_bytes()[:4] == b"\x89PNG"
    assert "By pruning rate" in md


def test_the_shipped_rate_study_plans_two_allocators_by_four_rates_by_three_seeds():
    p = plan(["experiment=cppo_rates_arith"])
    assert len(p.runs) == 24 and p.options.seeds == 3
    assert sorted({r.cfg.pruner.rate for r in p.runs}) == [0.0, 0.5, 0.75, 0.875]
    assert sorted({r.cfg.allocator.name for r in p.runs}) == ["dynamic", "static"]
    assert [(r.cfg.allocator.name, r.cfg.pruner.rate, r.seed) for r in p.baseline_runs()] == [
        ("static", 0.0, 42), ("static", 0.0, 43), ("static", 0.0, 44)]
    assert all(list(r.cfg.eval.tasks) == ["arith"] for r in p.runs)


def test_the_rate_plot_draws_one_line_per_setting_besides_the_rate():
    from gpo.study.plots import _without_rate

    assert _without_rate("allocator=static pruner.rate=0.5") == "allocator=static"
    assert _without_rate("algo=dapo pruner.rate=0.75 allocator=dynamic") == "algo=dapo allocator=dynamic"
    assert _without_rate("pruner.rate=0.5") == "all runs"
