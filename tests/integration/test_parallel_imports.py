"""A single-process run never imports DeepSpeed (seconds of import time and, on CPU, its accelerator warning).

Each check runs in a fresh interpreter: this test process may have imported DeepSpeed for other tests already.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from kit import HANG_S, REPO

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed: nothing could import it")

# A stage-0 accelerator, a prepared tiny model, unwrapped and saved as the engine's save_model does.
SINGLE_PROCESS_SAVE = """
import sys, tempfile
import torch
from transformers import LlamaConfig, LlamaForCausalLM
{setup}
config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
model = LlamaForCausalLM(config)
{prepare}
with tempfile.TemporaryDirectory() as out:
    model.save_pretrained(out)
print("deepspeed" in sys.modules)
"""

GPO_ACCELERATOR = """
from gpo.config import EngineConfig, OptimConfig, TrainConfig
from gpo.parallel import build_accelerator
accelerator = build_accelerator(EngineConfig(), TrainConfig(), OptimConfig())
"""
PREPARED = """
prepared = accelerator.prepare(model)
model = accelerator.unwrap_model(prepared)
"""


def _run(code: str) -> tuple[bool, str]:
    """Whether `code` imported DeepSpeed, and what it printed to stderr."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                         timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    return {"True": True, "False": False}[out.stdout.strip().splitlines()[-1]], out.stderr


@needs_deepspeed
def test_stage_zero_accelerator_unwrap_and_save_leave_deepspeed_unimported():
    imported, stderr = _run(SINGLE_PROCESS_SAVE.format(setup=GPO_ACCELERATOR, prepare=PREPARED))
    assert not imported
    assert "real_accelerator.py" not in stderr  # DeepSpeed's "Setting accelerator to ..." line


@needs_deepspeed
def test_without_gpo_accelerate_imports_deepspeed_on_save():
    """The control: Accelerate's own unwrap (inside save_pretrained) imports DeepSpeed whenever it is installed,
    so the test above would see it if gpo.parallel did not defer it."""
    imported, _ = _run(SINGLE_PROCESS_SAVE.format(setup="", prepare=""))
    assert imported


def test_engines_built_one_after_another_each_get_their_own_mixed_precision():
    # Accelerate refuses a second Accelerator with another precision in one process; gpo's engines must not.
    code = """
    from gpo.config import EngineConfig, OptimConfig, TrainConfig
    from gpo.parallel import build_accelerator
    seen = [build_accelerator(EngineConfig(mixed_precision=p), TrainConfig(), OptimConfig()).mixed_precision
            for p in ("no", "bf16", "no")]
    print(seen == ["no", "bf16", "no"])
    """
    printed, _ = _run(code)
    assert printed


@needs_deepspeed
@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed: nothing to hide")
def test_deepspeed_is_imported_without_mlflow_and_mlflow_still_imports_afterwards():
    """DeepSpeed's autotuner imports mlflow (seconds) whenever it can; gpo's import of DeepSpeed hides it for that
    one import, and a later `import mlflow` (gpo's tracking) finds it. With mlflow imported first, DeepSpeed sees it."""
    check = """
    import os, sys
    os.environ["DS_ACCELERATOR"] = "cpu"
    {first}
    from gpo.parallel import _import_deepspeed
    _import_deepspeed()
    assert "deepspeed" in sys.modules  # imported here, whether mlflow was hidden or not
    from deepspeed.autotuning import autotuner
    print(autotuner.has_mlflow, "mlflow" in sys.modules, end=" ")
    import mlflow
    print(mlflow.__name__, end=" ")
    print("deepspeed" in sys.modules)
    """
    for first, seen in (("", "False False mlflow True"), ("import mlflow", "True True mlflow True")):
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(check.format(first=first))], cwd=REPO,
                             capture_output=True, text=True, timeout=HANG_S)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == seen, (first, out.stdout)
