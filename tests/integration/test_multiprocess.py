"""Several ranks on CPU (gloo): `gpo run engine.num_processes=2` re-launches itself under `accelerate launch`,
trains exactly what one process trains on the same global batch, and only rank 0 tracks and saves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpo import launch
from gpo.config import EngineConfig
from gpo.errors import UserError
from kit import MULTI_RANK, finish, records, start


def mlflow_runs(run_dir: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    return client.search_runs(client.get_experiment_by_name("gpo").experiment_id)


@pytest.mark.slow
def test_two_ranks_train_exactly_what_one_process_trains(tiny_model_path, tmp_path):
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", "tracker=mlflow", *MULTI_RANK]
    one = start([*base, "run_name=one"], tmp_path / "one.jsonl")
    two = start([*base, "run_name=two", "engine=ddp", "engine.num_processes=2"], tmp_path / "two.jsonl")
    finish(one)
    out = finish(two)
    assert "launching 2 processes" in out

    # The same global step: equal parameters, and they did move away from the initial weights.
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    p1 = load_file(str(tmp_path / "one/final/model.safetensors"))
    p2 = load_file(str(tmp_path / "two/final/model.safetensors"))
    assert p1.keys() == p2.keys()
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], atol=1e-5, rtol=0, msg=name)
    assert max(float((p1[n] - initial[n]).abs().max()) for n in p1) > 1e-4
    steps = {r["rank"]: r["metrics"] for r in records(tmp_path / "two.jsonl", "step")}
    (single,) = [r["metrics"] for r in records(tmp_path / "one.jsonl", "step")]
    for rank in (0, 1):  # each rank trains on its share; the step's metrics are reduced over both ranks
        for key, value in single.items():
            if key.startswith(("loss/", "kl/", "clip/", "ratio/")):
                assert steps[rank][key] == pytest.approx(value, abs=1e-5), key
        assert steps[rank]["train/rows"] == single["train/rows"] == 8

    # Pruning decided on the whole batch, then an even split: 4 kept rows on each rank.
    shards = records(tmp_path / "two.jsonl", "shard")
    assert sorted((r["rank"], r["rows"], r["world_size"]) for r in shards) == [(0, 4, 2), (1, 4, 2)]

    # Only rank 0 tracks and writes the final model; one MLflow run in the store.
    trackers = {r["rank"]: r["name"] for r in records(tmp_path / "two.jsonl", "tracker")}
    assert trackers == {0: "MlflowTracker", 1: "NullTracker"}
    assert {r["rank"] for r in records(tmp_path / "two.jsonl", "save_pretrained")} == {0}
    (run,) = mlflow_runs(tmp_path / "two")
    assert run.info.status == "FINISHED" and run.data.metrics["train/rows"] == 8


def test_launch_command_on_cpu(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cmd, env = launch.command(EngineConfig(num_processes=3), ["task=toy", "--config", "x.yaml"])
    assert cmd[1:4] == ["-m", "accelerate.commands.launch", "--num_processes"] and cmd[4] == "3"
    assert "--multi_gpu" in cmd and env["ACCELERATE_USE_CPU"] == "true"
    assert cmd[-6:] == ["-m", "gpo", "run", "task=toy", "--config", "x.yaml"]
    cmd, env = launch.command(EngineConfig(num_processes=2, deepspeed_stage=3), [])
    assert cmd[cmd.index("--zero_stage") + 1] == "3" and "--use_deepspeed" in cmd and "--multi_gpu" not in cmd
    assert env["DS_ACCELERATOR"] == "cpu"


def test_launch_only_from_outside_a_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launch.needs_launch(EngineConfig(num_processes=2))
    assert not launch.needs_launch(EngineConfig(num_processes=1))
    monkeypatch.setenv("WORLD_SIZE", "2")  # inside a rank: train, never launch again
    assert not launch.needs_launch(EngineConfig(num_processes=2))
    from gpo.config import compose

    with pytest.raises(UserError, match="`engine.num_processes` must be >= 1"):  # checked when composing
        compose(["tracker=none", "engine.num_processes=0"])


def test_more_processes_than_gpus_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="only 1 GPU"):
        launch.command(EngineConfig(num_processes=2), [])
