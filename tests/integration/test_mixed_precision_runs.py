"""engine.mixed_precision=bf16 in engine runs (docs/precision.md): a bf16 run with old-policy and reference passes
resumes exactly and keeps float32 weights and AdamW state; bf16 under DDP and ZeRO-2 (2 ranks on CPU, gloo) trains
with finite losses. The module-level checks (bf16 against float32) are in tests/unit/test_mixed_precision.py."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kit import MULTI_RANK, finish, records, start

STEPS = [a for a in MULTI_RANK if not a.startswith("train.steps=")] + ["train.steps=2", "tracker=none"]
BF16 = ["engine.mixed_precision=bf16", "optim.schedule=constant"]


@pytest.mark.slow
def test_a_bf16_run_resumes_exactly_and_keeps_float32_weights_and_adamw_state(tiny_model_path, tmp_path):
    """mu=2 runs the old-policy pass and grpo's beta the reference pass, both in bf16 (logprob_precision=train).
    Two steps with a checkpoint after each; then, with the step-2 checkpoint and final model gone, `resume=auto`
    runs step 2 again from the step-1 checkpoint and must end on bit-equal weights."""
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", *STEPS, *BF16, "train.mu=2", "algo.beta=0.04",
            "run_name=run", "checkpoint.every=1", "checkpoint.keep_last=0"]
    finish(start(base, tmp_path / "straight.jsonl"))
    run = tmp_path / "run"
    a = load_file(str(run / "final/model.safetensors"))
    optimizer = torch.load(run / "checkpoints/step-0000002/optimizer.bin", weights_only=False)
    shutil.rmtree(run / "checkpoints" / "step-0000002")
    shutil.rmtree(run / "final")
    out = finish(start([*base, "resume=auto"], tmp_path / "resumed.jsonl"))
    assert "resumed from" in out and "at step 1" in out
    b = load_file(str(run / "final/model.safetensors"))

    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    assert {v.dtype for v in a.values()} == {torch.float32}  # master weights, not bf16 copies
    state = [t for s in optimizer["state"].values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    assert state and {t.dtype for t in state} == {torch.float32}  # AdamW's exp_avg and exp_avg_sq
    assert max(float((a[k] - initial[k]).abs().max()) for k in a) > 1e-4
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=0, rtol=0, msg=k)
    steps = records(tmp_path / "straight.jsonl", "step")
    assert len(steps) == 2 and all(math.isfinite(r["metrics"]["loss/total"]) for r in steps)


@pytest.mark.slow
def test_bf16_under_ddp_and_zero2_trains_with_finite_losses(tiny_model_path, tmp_path):
    pytest.importorskip("deepspeed")
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", *STEPS, *BF16, "train.steps=1",
            "checkpoint.save_final_model=false"]
    ddp = start([*base, "run_name=ddp", "engine.num_processes=2"], tmp_path / "ddp.jsonl")
    zero2 = start([*base, "run_name=zero2", "engine=zero2"], tmp_path / "zero2.jsonl")
    for proc in (ddp, zero2):
        finish(proc)
    for name in ("ddp", "zero2"):
        steps = records(tmp_path / f"{name}.jsonl", "step")
        assert sorted(r["rank"] for r in steps) == [0, 1], name
        assert all(math.isfinite(r["metrics"]["loss/total"]) and r["metrics"]["tokens/trained"] > 0
                   for r in steps), name


@pytest.mark.slow
def test_bf16_asked_for_runs_on_this_machine_and_says_once_where_it_is_emulated(tiny_model_path, tmp_path):
    """backend.precision=bf16 (a bfloat16 generator copy) and bf16 updates run on any CPU: where bfloat16 is only
    emulated (AVX2) the run says so in one line and still finishes, with finite losses."""
    from gpo.hardware import slow_bf16, this_machine

    args = [f"model={tiny_model_path}", f"output_dir={tmp_path}", *STEPS, *BF16, "backend=hf", "backend.precision=bf16",
            "checkpoint.save_final_model=false"]
    out = finish(start(args, tmp_path / "bf16.jsonl"))
    steps = records(tmp_path / "bf16.jsonl", "step")
    assert len(steps) == 2 and all(math.isfinite(r["metrics"]["loss/total"]) for r in steps)
    why = slow_bf16(this_machine())
    said = [line for line in out.splitlines() if "bf16 is emulated here" in line]
    assert len(said) == (1 if why else 0), out
    assert not said or said[0].startswith("gpo: engine.mixed_precision=bf16 backend.precision=bf16: "), said
