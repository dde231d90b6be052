"""DeepSpeed ZeRO-2 and ZeRO-3 through Accelerate on CPU (gloo, 2 ranks): two steps finish with finite losses,
move the parameters, and land where one plain process lands; only rank 0 saves. Skipped without deepspeed."""

from __future__ import annotations

import importlib.util
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpo.config import EngineConfig, OptimConfig, TrainConfig
from gpo.parallel import deepspeed_config
from kit import MULTI_RANK, finish, records, start

# find_spec, not importorskip: importing DeepSpeed costs seconds in every test worker that collects this file.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

STEPS = [a for a in MULTI_RANK if not a.startswith("train.steps=")] + ["train.steps=2", "tracker=none"]


@pytest.mark.slow
def test_zero2_and_zero3_train_like_one_process(tiny_model_path, tmp_path):
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", *STEPS]
    one = start([*base, "run_name=one"], tmp_path / "one.jsonl")
    # ZeRO-2 the way a user launches by hand; ZeRO-3 through gpo's own re-launch.
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", "2",
                  "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--main_process_port", "0"]
    zero2 = start([*base, "run_name=zero2", "engine=zero2"], tmp_path / "zero2.jsonl", env={"DS_ACCELERATOR": "cpu"},
                  launcher=accelerate)
    zero3 = start([*base, "run_name=zero3", "engine=zero3"], tmp_path / "zero3.jsonl")
    for proc in (one, zero2, zero3):
        finish(proc)

    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    reference = load_file(str(tmp_path / "one/final/model.safetensors"))
    for name in ("zero2", "zero3"):
        probe = tmp_path / f"{name}.jsonl"
        steps = records(probe, "step")
        assert sorted(r["rank"] for r in steps) == [0, 0, 1, 1]
        assert all(math.isfinite(r["metrics"]["loss/total"]) for r in steps)
        assert {r["rank"] for r in records(probe, "save_pretrained")} == {0}
        params = load_file(str(tmp_path / name / "final/model.safetensors"))
        assert params.keys() == initial.keys()  # ZeRO-3 saves gathered full weights, not empty shards
        assert max(float((params[k] - initial[k]).abs().max()) for k in params) > 1e-4
        # One DeepSpeed optimizer step per engine step, over the accumulated micro-batches of both ranks.
        for k in params:
            torch.testing.assert_close(params[k], reference[k], atol=1e-5, rtol=0, msg=f"{name}: {k}")


@pytest.mark.slow
def test_zero3_with_offload_and_bf16_resumes_where_it_left_off(tiny_model_path, tmp_path):
    """The hardest combination DeepSpeed runs on this CPU: parameters and optimizer state offloaded, bf16 mixed
    precision. Two steps with a checkpoint after each; then, as if the run had stopped after step 1 (its step-2
    checkpoint and final model gone), `resume=auto` runs step 2 again from the step-1 checkpoint and ends on the same
    weights. (Two launches of 2 ranks, not three: the uninterrupted run is the one that left the checkpoint.)"""
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", *STEPS, "engine=zero3", "engine.offload=true",
            "engine.mixed_precision=bf16", "optim.schedule=constant", "run_name=run", "checkpoint.every=1"]
    finish(start(base, tmp_path / "straight.jsonl"))
    run = tmp_path / "run"
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    a = load_file(str(run / "final/model.safetensors"))
    shutil.rmtree(run / "checkpoints" / "step-0000002")
    shutil.rmtree(run / "final")
    out = finish(start([*base, "resume=auto"], tmp_path / "resumed.jsonl"))
    assert "resumed from" in out and "at step 1" in out

    b = load_file(str(run / "final/model.safetensors"))
    assert {v.dtype for v in a.values()} == {torch.bfloat16}  # DeepSpeed saves the bf16 module weights
    assert max(float((a[k].float() - initial[k].float()).abs().max()) for k in a) > 1e-3
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=0, rtol=0, msg=k)  # the restored run repeats step 2 exactly
    assert sorted(r["rank"] for r in records(tmp_path / "straight.jsonl", "step")) == [0, 0, 1, 1]
    assert sorted(r["rank"] for r in records(tmp_path / "resumed.jsonl", "step")) == [0, 1]  # only step 2, both ranks


def test_deepspeed_config_is_consistent_and_clips():
    engine, train, optim = EngineConfig(deepspeed_stage=3, offload=True), TrainConfig(micro_batch_size=4), OptimConfig()
    cfg = deepspeed_config(engine, train, optim, world_size=2)
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 2
    assert cfg["gradient_clipping"] == optim.max_grad_norm
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert "offload_param" not in deepspeed_config(EngineConfig(deepspeed_stage=2, offload=True), train, optim,
                                                   2)["zero_optimization"]
