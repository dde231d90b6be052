"""Decode-step levers not kept in gpo's decoder, measured: is one new token's forward cheaper with them here?

The forward of one decode step (one new token for every row, with the cache of the prompt plus 16 tokens) at the
default size's row count, three ways, on the same weights and inputs:
  eager-dynamic   what gpo's decoder runs: transformers' DynamicCache, eager PyTorch
  eager-static    transformers' StaticCache (preallocated to prompt + max new tokens), eager
  compiled-static torch.compile of the model's forward over that StaticCache (the layout compile needs: fixed
                  shapes, so one graph serves every step); its one-time compile is reported apart
Each arm's first steps warm it up (and compile it); the timed steps are interleaved arm by arm.
Then whole generations at that size: gpo's decoder (`backend=hf`) against transformers' continuous batching
(`generate_batch`, paged cache, its own scheduler and sampler), interleaved, tokens per second.

    python bench/decode_levers.py --rows 64 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import add_common, engine, spread, table, write_section


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=32, help="the static cache holds prompt + this many tokens")
    p.add_argument("--repeats", type=int, default=20)
    add_common(p)
    args = p.parse_args()

    import torch
    from transformers import StaticCache

    from gpo.generation import encode_prompts, pad

    eng = engine(f"model.path={args.model}", "task=arith", *args.set)
    model = eng.policy.eval()
    prompts = encode_prompts(eng.tokenizer, [eng.task.prompt(q) for q in eng.questions.take(args.questions)], 256)
    ids, mask = pad(prompts, eng.tokenizer.pad_token_id, left=True)
    ids, mask = ids.repeat_interleave(args.group, 0), mask.repeat_interleave(args.group, 0)  # [R, Lp]
    rows, prompt_len = ids.shape
    length = prompt_len + args.max_new
    compiled_forward = torch.compile(model.forward, dynamic=False)

    def filled(arm: str):
        """A cache holding the prompt plus 16 tokens, the mask and the next token for this arm."""
        cache = None if arm == "eager-dynamic" else StaticCache(config=model.config, max_cache_len=length)
        step_mask = mask
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        for _ in range(16):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            step_mask = torch.cat([step_mask, step_mask.new_ones(rows, 1)], dim=1)
            out = model(input_ids=token, attention_mask=step_mask, past_key_values=cache, use_cache=True,
                        position_ids=step_mask.sum(1, keepdim=True) - 1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        return cache, torch.cat([step_mask, step_mask.new_ones(rows, 1)], dim=1), token

    arms = ["eager-dynamic", "eager-static", "compiled-static"]
    timings: dict[str, list[float]] = {a: [] for a in arms}
    compile_seconds = 0.0
    with torch.no_grad():
        state = {a: filled(a) for a in arms}
        for r in range(args.repeats + 2):  # two untimed rounds: warm-up, and the compile of compiled-static
            for arm in arms:
                cache, step_mask, token = state[arm]
                forward = compiled_forward if arm == "compiled-static" else model.forward
                position = step_mask.sum(1, keepdim=True) - 1
                cache_position = torch.tensor([step_mask.shape[1] - 1])
                t0 = time.perf_counter()
                forward(input_ids=token, attention_mask=step_mask, past_key_values=cache, use_cache=True,
                        position_ids=position, cache_position=cache_position)
                dt = time.perf_counter() - t0
                if arm == "eager-dynamic":
                    cache.crop(-1)  # the same step again next round
                if r >= 2:
                    timings[arm].append(dt)
                elif arm == "compiled-static":
                    compile_seconds += dt
    base = statistics.median(timings["eager-dynamic"])
    result = [[arm, spread([1000 * t for t in timings[arm]]), f"{base / statistics.median(timings[arm]):.2f}x"]
              for arm in arms]
    body = (f"Model `{args.model}`, {rows} rows ({args.questions} arith prompts x {args.group}), prompt {prompt_len} "
            f"tokens plus 16 in the cache, static cache of {length}; {args.repeats} timed steps per arm, "
            f"interleaved, median (min-max) ms; torch.compile's first two calls took {compile_seconds:.0f} s.\n\n"
            + table(["arm", "decode step forward (ms)", "speed vs eager-dynamic"], result))
    body += "\n\n" + _whole_generation(eng, prompts, args)
    print(body)
    write_section("decode_levers", "Decode-step levers: static cache and torch.compile", body, args)


def _whole_generation(eng, prompts: list[list[int]], args) -> str:
    """Tokens per second of whole generations: gpo's decoder vs transformers' generate_batch, interleaved."""
    from transformers import GenerationConfig

    from gpo.backends.hf import HFBackend, HFConfig
    from gpo.types import Sampling

    tok, model = eng.tokenizer, eng.policy
    ours = HFBackend(HFConfig(), model, tok)
    sampling = Sampling(max_new_tokens=args.max_new, temperature=1.0)
    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new,
                               num_return_sequences=args.group, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id)

    def hf_gpo(seed: int) -> int:
        return sum(len(r) for r in ours.generate(prompts, args.group, sampling, seed=seed))

    def continuous(seed: int) -> int:
        out = model.generate_batch(inputs=prompts, generation_config=gen_cfg, progress_bar=False)
        return sum(len(o.generated_tokens) for o in out.values())

    arms = {"hf (gpo decoder)": hf_gpo, "transformers generate_batch": continuous}
    speed: dict[str, list[float]] = {a: [] for a in arms}
    errors: dict[str, str] = {}
    for r in range(max(2, args.repeats // 5) + 1):  # the first round warms up and is not counted
        for name, run in arms.items():
            if name in errors:
                continue
            t0 = time.perf_counter()
            try:
                tokens = run(100 + r)
            except Exception as exc:  # a path that does not run here is reported, not hidden
                errors[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
                continue
            if r:
                speed[name].append(tokens / (time.perf_counter() - t0))
    rows = [[name, errors.get(name) or spread(speed[name])] for name in arms]
    return (f"Whole generations, {len(prompts)} prompts x {args.group} samples x {args.max_new} new tokens, "
            f"T=1, tokens per second, median (min-max):\n\n" + table(["path", "tokens/s"], rows))


if __name__ == "__main__":
    main()
