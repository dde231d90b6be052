"""Two real ranks (gloo) train exactly what one process trains, for objectives whose maths spans more than a token:
REINFORCE++'s advantages are whitened over the whole gathered batch (a per-rank whitening would give other
weights), and RLOO's / GSPO's one ratio per completion with mu = 2 uses old log-probs of whole rows on each rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kit import MULTI_RANK, finish, records, start


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["algo=reinforce_pp"], ["algo=rloo", "train.mu=2"], ["algo=gspo", "train.mu=2"]],
                         ids=["reinforce_pp", "rloo-mu2", "gspo-mu2"])
def test_two_ranks_train_what_one_process_trains(tiny_model_path, tmp_path, extra):
    # AdamW's first step moves a weight by lr * g / (|g| + eps): near g = 0 that amplifies the gradient's rounding
    # by lr / eps (1e5 at eps 1e-8), and one process and two ranks sum a gradient in different orders. At eps 1e-6
    # rounding of 1e-10 moves a weight by 1e-7, well inside the 1e-5 compared, on any CPU's kernels.
    common = [a for a in MULTI_RANK if not a.startswith("algo=")] + extra + ["optim.eps=1e-6"]
    base = [f"model={tiny_model_path}", f"output_dir={tmp_path}", "tracker=none", *common]
    one = start([*base, "run_name=one"], tmp_path / "one.jsonl")
    two = start([*base, "run_name=two", "engine=ddp", "engine.num_processes=2"], tmp_path / "two.jsonl")
    finish(one)
    assert "launching 2 processes" in finish(two)
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    p1 = load_file(str(tmp_path / "one/final/model.safetensors"))
    p2 = load_file(str(tmp_path / "two/final/model.safetensors"))
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], atol=1e-5, rtol=0, msg=name)
    assert max(float((p1[n] - initial[n]).abs().max()) for n in p1) > 1e-4  # the step did move the weights
    (single,) = [r["metrics"] for r in records(tmp_path / "one.jsonl", "step")]
    for rank_metrics in (r["metrics"] for r in records(tmp_path / "two.jsonl", "step")):
        for key in ("loss/total", "loss/policy", "adv/std", "adv/abs_mean"):
            assert rank_metrics[key] == pytest.approx(single[key], abs=1e-5), key
