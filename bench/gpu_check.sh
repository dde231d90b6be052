#!/usr/bin/env bash
# GPU check: a few GRPO and CPPO steps (hf backend) on a Qwen2.5-1.5B-shaped model with random bf16 weights, on a
# machine with one GPU and no network, and CPPO steps with bf16 updates over float32 weights, a bf16 generator and
# the mismatch correction (and vLLM's fp8 generator where vLLM and CUDA are present). Prints the losses (must be finite),
# seconds per phase and KL(gen, train) of each step, then runs the phase benchmark (bench/phases.py), the
# step-vs-Amdahl benchmark (bench/steps.py) and the precision steps (bench/precision_steps.py) on the same model.
# Everything it prints is also written to $OUT/gpu_check.log when $OUT is set (else ./gpu_check.log); the tables
# go into docs/benchmarks.md by hand, with the date (the benchmarks run with --no-write there).
#
#   bench/gpu_check.sh --prepare   on a machine WITH network and the same Python version as the GPU machine:
#                                  wheels of gpo and its dependencies into wheels/ (git-ignored), minus the torch,
#                                  transformers, accelerate and CUDA wheels the GPU machine already has, plus the
#                                  SmolLM2 tokenizer files (wheels/tokenizer/). Copy the repository with wheels/.
#   bench/gpu_check.sh             on the GPU machine: installs gpo from wheels/ (--no-index) and runs the check.
#   GPO_GPU_CHECK_SMOKE=1 bench/gpu_check.sh
#                                  CPU smoke test of this script: a 2-layer model of width 64, fewer steps.
#
# Tokenizer: SmolLM2's (vocab 49152) instead of Qwen's (151936), so nothing is downloaded; the model config uses
# its vocabulary size, which shrinks the embedding (tied, as in Qwen2.5-1.5B) from 233M to 75M parameters. Every
# other dimension is Qwen2.5-1.5B's: 28 layers, hidden 1536, MLP 8960, 12 heads, 2 KV heads, rope theta 1e6.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${GPO_WHEELS:-wheels}

if [[ "${1:-}" == "--prepare" ]]; then
    python -m pip wheel --wheel-dir "$WHEELS" '.[deepspeed]'
    rm -f "$WHEELS"/torch-* "$WHEELS"/transformers-* "$WHEELS"/accelerate-* "$WHEELS"/nvidia_* "$WHEELS"/triton-*
    python - "$WHEELS/tokenizer" <<'PY'
import sys
from gpo.config import ModelConfig
from gpo.models import load_tokenizer
load_tokenizer(ModelConfig()).save_pretrained(sys.argv[1])
PY
    echo "gpu_check: prepared $WHEELS/ ($(ls "$WHEELS" | wc -l) entries); copy it with the repository"
    exit 0
fi

if ! python -c "import gpo" 2>/dev/null; then
    python -m pip install --quiet --no-index --find-links "$WHEELS" .
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
LOG=${OUT:-.}/gpu_check.log
exec > >(tee "$LOG") 2>&1
timeout 300 python - "$WORK" "$WHEELS/tokenizer" <<'PY'
import importlib.util, math, os, sys, time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

work, tokenizer_dir = Path(sys.argv[1]), Path(sys.argv[2])
smoke = os.environ.get("GPO_GPU_CHECK_SMOKE") == "1"
if not smoke and not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device (GPO_GPU_CHECK_SMOKE=1 runs the CPU smoke version)")

if tokenizer_dir.is_dir():
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
else:  # smoke runs on the development machine: the embedded model's tokenizer
    from gpo.config import ModelConfig
    from gpo.models import load_tokenizer
    tokenizer = load_tokenizer(ModelConfig())
shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2) if smoke else \
        dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
             num_key_value_heads=2)
config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=4096, rope_theta=1e6,
                     tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)
torch.manual_seed(0)
model = Qwen2ForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(work / "model")
tokenizer.save_pretrained(work / "model")
print(f"gpu_check: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, bf16, "
      f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}", flush=True)
del model

from gpo.config import compose
from gpo.engine import Engine

steps = 2 if smoke else 4
common = [f"model={work / 'model'}", "model.dtype=bfloat16", "task=arith", "backend=hf", "tracker=none",
          f"output_dir={work / 'runs'}", f"train.steps={steps}", "train.questions_per_step=4",
          "train.group_size=8", f"train.max_completion_length={16 if smoke else 128}",
          f"train.micro_batch_size={8 if smoke else 16}", "optim.lr=1e-6", "eval.before_and_after=false"]
cppo = ["algo=grpo", "pruner=topk", "pruner.rate=0.75", "allocator=dynamic"]
# precision: float32 master weights with bf16 updates, a bf16 generator copy refreshed every step, and the
# mismatch correction; vllm-fp8: vLLM's online fp8 generator (only with vLLM and a CUDA device).
low = ["model.dtype=float32", "engine.mixed_precision=bf16", "correction=tis"]
runs = {"grpo": ["algo=grpo", "pruner=none", "allocator=static"], "cppo": cppo}
from gpo.hardware import this_machine

if this_machine().bf16:  # every bf16 GPU; in smoke mode, CPUs with native bf16 only
    runs["precision"] = [*cppo, *low, "backend.precision=bf16"]
else:
    print("gpu_check: no native bf16 here; the precision run is skipped", flush=True)
if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():  # fp8 is vLLM's on CUDA only
    print("gpu_check: no vLLM or no CUDA device; the vllm-fp8 run is skipped", flush=True)
else:
    runs["vllm-fp8"] = [*cppo, *low, "backend=vllm", "backend.precision=fp8"]
failed = False
for name, picks in runs.items():
    engine = Engine(compose([*common, *picks, f"run_name={name}"]))
    print(f"\n{name}: step  loss        kept   generate  logprobs  update   step (s)  KL(gen, train)", flush=True)
    for _ in range(steps):
        m = engine.step()
        finite = math.isfinite(m.get("loss/total", float("nan")))
        failed |= not finite
        print(f"{name}: {engine.step_index:>4}  {m.get('loss/total', float('nan')):<10.4g}  "
              f"{m['prune/kept_frac']:.2f}  {m.get('time/generate', 0):8.2f}  {m.get('time/logprobs', 0):8.2f}  "
              f"{m.get('time/update', 0):6.2f}  {m['time/step']:7.2f}  {m.get('mismatch/kl_gen_train', float('nan')):.2e}"
              f"{'' if finite else '  NOT FINITE'}", flush=True)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"{name}: peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
        torch.cuda.reset_peak_memory_stats()
sys.exit("gpu_check: FAILED (a loss is not finite)" if failed else 0)
PY
# The benchmarks on the same model; bf16, no KL-free shortcuts (beta 0.04 as in the CPU tables).
SET=(--set "model.dtype=bfloat16" "backend=hf" --no-write)
if [[ "${GPO_GPU_CHECK_SMOKE:-}" == "1" ]]; then SIZE=(--max-new 8 --repeats 1); else SIZE=(--max-new 128 --repeats 2); fi
timeout 150 python bench/phases.py --model "$WORK/model" --questions 4 --micro-batch 16 "${SIZE[@]}" "${SET[@]}"
timeout 180 python bench/steps.py --model "$WORK/model" --questions 4 "${SIZE[@]}" "${SET[@]}"
# Rollout x update precision on float32 master weights (bf16 updates need them); fp8 is vLLM's, not this script's.
if [[ "${GPO_GPU_CHECK_SMOKE:-}" == "1" ]]; then NEW=8; else NEW=128; fi
# (it leaves out by itself what this machine cannot run)
timeout 120 python bench/precision_steps.py --model "$WORK/model" --rollout float32 bf16 --repeats 1 --no-write \
    --set "model.dtype=float32" "backend=hf" "train.questions_per_step=4" "train.max_completion_length=$NEW"
echo "gpu_check: OK"
