"""What tests/integration/test_model_matrix.py runs in a subprocess per architecture: the vLLM backend on a zoo model.

`python tests/model_matrix_vllm.py WORKDIR NAME=MODEL_DIR ...` checks each model in turn, in this one process, and
writes WORKDIR/NAME/result.json: greedy completions from HF and vLLM, how far vLLM's reported sampling log-probs are
from the trainer's, whether a real engine step's weights reached vLLM, and whether every reward was computed from
exactly the text vLLM generated for its row. A model whose checks raise gets WORKDIR/NAME/error.txt (the traceback)
instead, and the next model is still checked. One process for all of them: each start of Python + torch +
transformers + vLLM costs about half a minute on 2 CPU cores, and each model's engine is shut down before the next
one starts (vLLM's shutdown also destroys the process group it created, so the next engine makes its own).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def checks(model: str, workdir: Path) -> dict:
    from gpo.config import compose
    from gpo.engine import Engine

    engine = Engine(compose([
        f"model={model}", f"output_dir={workdir / 'runs'}", "backend=vllm", "tracker=none", "task=toy",
        "plugins=[gpo_toy]", "algo=grpo", "algo.beta=0", "pruner=none", "allocator=static",
        "train.questions_per_step=2", "train.group_size=4", "train.max_completion_length=8",
        "train.micro_batch_size=8", "optim.lr=1e-2", "optim.warmup_ratio=0", "optim.schedule=constant",
        "eval.before_and_after=false",
    ]))
    try:
        return _engine_checks(engine)
    finally:  # also after a failed check: the next model's vLLM engine must not start beside this one
        engine.backend.close()


def _engine_checks(engine) -> dict:
    from gpo.backends.hf import HFBackend, HFConfig
    from gpo.generation import encode_prompts, generate
    from gpo.logprobs import batch_logprobs
    from gpo.types import Sampling
    from vllm_checks import _trainer_logprobs, _vllm_fixed_logprobs

    tok, policy, backend = engine.tokenizer, engine.policy, engine.backend
    system = {"role": "system", "content": "Answer briefly."}
    questions = ("What is 2+3?", "Name a colour.")
    prompts = encode_prompts(tok, [[system, {"role": "user", "content": q}] for q in questions], 64)
    greedy = Sampling(max_new_tokens=8, greedy=True)
    result: dict = {"greedy_hf": HFBackend(HFConfig(), policy, tok).generate(prompts, 1, greedy, seed=0),
                    "greedy_vllm": backend.generate(prompts, 1, greedy, seed=0)}

    sampled = generate(backend, prompts, 4, Sampling(max_new_tokens=8, temperature=0.7), seed=1,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    trainer = batch_logprobs(engine.module, sampled, 8, 0.7)  # [N, L]
    m = sampled.completion_mask.bool()
    result["sampled_max_abs_diff"] = float((trainer - sampled.generator_logprobs)[m].abs().max())

    generated, rewarded = [], []
    plain_generate, plain_reward = backend.generate, engine.task.reward

    def recording_generate(prompt_ids, n, sampling, seed):
        out = plain_generate(prompt_ids, n, sampling, seed)
        generated.extend(out)
        return out

    def recording_reward(completions, examples):
        rewarded.extend(completions)
        return plain_reward(completions, examples)

    backend.generate, engine.task.reward = recording_generate, recording_reward
    fixed = tok.encode("Five, I think.", add_special_tokens=False)
    initial = _trainer_logprobs(policy, prompts[0], fixed)
    engine.step()  # generate with vLLM, reward, update, sync
    trained = _trainer_logprobs(policy, prompts[0], fixed)
    result["moved"] = float((trained - initial).abs().max())
    result["after_step_max_abs_diff"] = float((_vllm_fixed_logprobs(backend, prompts[0], fixed) - trained).abs().max())
    # The engine pads the rows into one matrix; each reward must still see exactly its row's generated text.
    own_text = [tok.decode(ids, skip_special_tokens=True) for ids in generated]
    result["rewards_match_texts"] = len(rewarded) == 8 and rewarded == own_text
    result["lengths"] = sorted(len(ids) for ids in generated)
    return result


def check_all(out_dir: Path, models: dict[str, str]) -> None:
    import traceback

    for name, model_dir in models.items():
        workdir = out_dir / name
        workdir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)  # each model's checks start from the same state, whatever ran before them
        try:
            (workdir / "result.json").write_text(json.dumps(checks(model_dir, workdir)))
        except Exception:  # reported by that model's test; the other models are still checked
            (workdir / "error.txt").write_text(traceback.format_exc())


if __name__ == "__main__":  # vLLM may spawn processes: only ever start it from here
    check_all(Path(sys.argv[1]), dict(arg.split("=", 1) for arg in sys.argv[2:]))
