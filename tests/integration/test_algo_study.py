"""Objectives train in one `gpo study` (a fresh process per run), with CPPO's pruning.

The grid runs on the tiny model (tests/conftest.py: a 2-layer Llama with SmolLM2's tokenizer and chat template),
not on SmolLM2-135M itself: one training step of the embedded default took 74-141 s on 2 shared
cores. The task is the `toy` plug-in, whose reward (completion length) varies even for a random model; on `arith`
such a model scores 0 everywhere, every advantage would be 0 and DAPO's dynamic sampling would drop every group,
so "trains" would mean nothing.

A run here is mostly its process starting (about 11 s of a core), so the study runs one objective of each kind
of loss rather than all nine: GRPO (sequence-mean token loss), DAPO (token-mean over the step, dynamic sampling
refilled from the pool), GSPO (a sequence-level ratio) and REINFORCE++ (advantages normalised over the whole step,
not the group). The study passes `algo=NAME` to each run and nothing else, so what the others would add is checked
elsewhere: every objective with every pruner, `none` included, trains on exactly its kept rows and moves the
weights in tests/integration/test_engine.py (in one process); the registry holds exactly these nine (below); and a
study's `pruner=none` run (kept_frac 1.0, its MLflow child run, the table) in tests/unit/test_study.py.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest

from gpo import cli, registry

sys.path.insert(0, str(Path(__file__).parents[1] / "plugins"))
ALGOS = ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "gmpo", "rloo", "reinforce_pp")
STUDIED = ("grpo", "dapo", "gspo", "reinforce_pp")


def test_the_grid_names_every_registered_objective():
    registry.load_builtins()
    assert sorted(ALGOS) == registry.names("algo")


@pytest.mark.slow
def test_an_objective_of_each_loss_kind_trains_with_pruning_in_one_study(tiny_model_path, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from gpo.tracking_store import read_run

    args = [
        f"model={tiny_model_path}", f"output_dir={tmp_path}", "task=toy", "plugins=[gpo_toy]", "tracker=mlflow",
        f"algo={','.join(STUDIED)}", "pruner=topk", "allocator=static", "train.steps=2",
        "train.questions_per_step=2", "train.group_size=4", "train.max_completion_length=8",
        "train.micro_batch_size=8", "eval.before_and_after=false",
        "study.parallel=2",  # two runs at once: most of a run is its process importing torch, one core each
    ]
    assert cli.main(["study", *args]) == 0
    assert f"study of {len(STUDIED)} runs" in capsys.readouterr().out
    (study_dir,) = tmp_path.glob("study-*")
    rows = list(csv.DictReader(open(study_dir / "study.csv")))
    assert [r["combination"] for r in rows] == [f"algo={a}" for a in STUDIED]
    failed = [(r["combination"], r["error"]) for r in rows if r["status"] != "FINISHED"]
    assert not failed, failed
    client = MlflowClient(f"sqlite:///{study_dir / 'mlflow.db'}")
    for row in rows:
        assert float(row["kept_frac"]) == 0.25, row  # topk's default rate 0.75 keeps 1 of G = 4 per question
        assert 0 < float(row["tokens_trained"]) <= float(row["tokens_generated"]), row
        metrics = read_run(client, row["run_id"]).metrics
        assert math.isfinite(metrics["loss/total"]), row["combination"]
        assert metrics["train/rows"] > 0 and metrics["train/grad_norm"] > 0, (row["combination"], metrics)
