"""Generation alone: tokens per second of a step's rollouts, for each generation path, side by side.

Arms (each generates the same prompts, with the same seeds, on the same weights in one process):
  hf-generate  transformers' `generate` on G copies of each prompt (`backend.decode=generate`, the path before)
  hf-gpo       gpo's decoder (`backend.decode=gpo`, the default): one prefill per prompt, its cache expanded to
               the G samples, inverse-CDF draws, finished rows dropped from the batch
  hf-gpo-bf16  gpo's decoder on a bfloat16 copy of the policy (`backend.precision=bf16`)
  hf-gpo-int8  gpo's decoder on a copy with int8 dynamically quantised Linear layers (`backend.precision=int8`);
               the columns "x hf-gpo" and "x vllm" are each precision's speed against float32's. By default
               the precisions this machine runs natively (gpo/backends/precision.py) are timed.
  vllm         vLLM (`backend=vllm`), when it is installed and `--vllm` is given (it starts its own engine)
  vllm-bf16    vLLM in bfloat16 (`backend=vllm backend.precision=bf16`), with `--vllm` where bf16 runs natively
Sizes: questions x G completions x new tokens; by default the training default (8 x 8, 32 new tokens) and
GSM8K-length completions (256 new tokens), with G = 8 and 16. Arms are interleaved and rotated per repeat.
Tokens per second counts the completion tokens returned (EOS included).
The profile of one decode step splits its time into the model's forward and drawing the next token at the size's
row count: multinomial (as `generate` does), a one-level inverse-CDF draw (a cumulative sum over the whole
vocabulary, gpo's earlier draw) and gpo's two-level draw (blocks, then tokens in the chosen block).

    python bench/generation.py --repeats 3
"""

from __future__ import annotations

import argparse
import time
from typing import Literal

from harness import add_common, engine, freeze_weights, spread, table, write_section


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sizes", nargs="*", default=SIZES, metavar="QxGxT",
                   help="questions x completions per question x new tokens")
    p.add_argument("--arms", nargs="+", choices=["hf-generate", "hf-gpo", *PRECISION_ARMS, *VLLM_ARMS],
                   help="time only these (default: the hf paths at every precision this machine runs, and vllm "
                        "with --vllm)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vllm", action="store_true", help="also time backend=vllm (starts a vLLM engine)")
    add_common(p)
    args = p.parse_args()

    from gpo import registry
    from gpo.backends.hf import HFBackend, HFConfig
    from gpo.backends.precision import runnable
    from gpo.generation import encode_prompts
    from gpo.hardware import this_machine
    from gpo.types import Sampling

    eng = engine(f"model.path={args.model}", "task=arith", *args.set)
    freeze_weights(eng)
    backends = {"hf-generate": HFBackend(HFConfig(decode="generate"), eng.policy, eng.tokenizer),
                "hf-gpo": HFBackend(HFConfig(decode="gpo"), eng.policy, eng.tokenizer)}
    here = runnable("hf", this_machine())
    for name, precision in PRECISION_ARMS.items():  # the copy is made in the warm-up round, which is not timed
        if precision in here or (args.arms and name in args.arms):
            backends[name] = HFBackend(HFConfig(precision=precision), eng.policy, eng.tokenizer)
    entry = registry.get("backend", "vllm")
    for name, vllm_precision in VLLM_ARMS.items():
        if (args.arms and name in args.arms) or (not args.arms and args.vllm and vllm_precision in ("auto", *here)):
            backends[name] = entry.build(entry.config(precision=vllm_precision), model=eng.policy,
                                         tokenizer=eng.tokenizer)
    backends = {name: b for name, b in backends.items() if not args.arms or name in args.arms}
    questions = eng.questions.take(max(int(s.split("x")[0]) for s in args.sizes))
    prompts_all = encode_prompts(eng.tokenizer, [eng.task.prompt(q) for q in questions], 256)

    rows, profile_rows = [], []
    for size in args.sizes:
        n_q, group, new = (int(x) for x in size.split("x"))
        prompts = prompts_all[:n_q]
        sampling = Sampling(max_new_tokens=new, temperature=1.0)
        speed: dict[str, list[float]] = {name: [] for name in backends}
        seconds: dict[str, list[float]] = {name: [] for name in backends}
        names = list(backends)
        for r in range(args.repeats + 1):  # the first round warms up every arm and is not counted
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                t0 = time.perf_counter()
                out = backends[name].generate(prompts, group, sampling, seed=1000 + r)
                dt = time.perf_counter() - t0
                if r:
                    speed[name].append(sum(len(x) for x in out) / dt)
                    seconds[name].append(dt)
        for name in names:
            ratios = [_ratio(speed, name, base) for base in ("hf-generate", "hf-gpo", "vllm")]
            rows.append([size, name, spread(seconds[name]), spread(speed[name]), *ratios])
        profile_rows.append([size, *_decode_step_profile(eng.policy, prompts, group, args.repeats)])
        print(table(HEADERS, rows), flush=True)

    body = (f"Model `{args.model}`, arith prompts (about 66 tokens with the chat template), sampling at T=1; "
            f"{args.repeats} timed repeats after one warm-up round, arms rotated; median (min-max).\n\n"
            + table(HEADERS, rows)
            + "\n\nOne decode step (one new token for every row, cache of the prompt plus 16 tokens), "
              "median (min-max) ms:\n\n" + table(PROFILE_HEADERS, profile_rows))
    print(body)
    variant = " ".join(([f"sizes {' '.join(args.sizes)}"] if args.sizes != SIZES else [])
                       + ([f"arms {' '.join(args.arms)}"] if args.arms else []))
    write_section("generation", "Generation: tokens per second by path", body, args, variant)


SIZES = ["8x8x32", "8x16x32", "8x8x256", "8x16x256"]
PRECISION_ARMS: dict[str, Literal["bf16", "int8"]] = {"hf-gpo-bf16": "bf16", "hf-gpo-int8": "int8"}
VLLM_ARMS: dict[str, Literal["auto", "bf16"]] = {"vllm": "auto", "vllm-bf16": "bf16"}
HEADERS = ["Q x G x new tokens", "arm", "seconds", "tokens/s", "x hf-generate", "x hf-gpo", "x vllm"]
PROFILE_HEADERS = ["Q x G x new tokens", "rows", "model forward", "softmax + multinomial",
                   "one-level inverse CDF", "two-level inverse CDF (gpo)"]


def _ratio(speed: dict[str, list[float]], name: str, base: str) -> str:
    """Paired per-repeat ratios of `name`'s tokens per second to `base`'s; '-' when `base` did not run."""
    if base not in speed:
        return "-"
    return spread([a / b for a, b in zip(speed[name], speed[base], strict=True)])


def _decode_step_profile(model, prompts: list[list[int]], group: int, repeats: int) -> list[object]:
    """ms of one decode step's parts at b*G rows: the forward with a cache, and the two ways to draw a token."""
    import torch

    from gpo.decoding import draw, next_token_weights
    from gpo.generation import pad

    ids, mask = pad(prompts, 0, left=True)
    ids, mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    rows = ids.shape[0]
    forward, multinomial, one_level, inverse = [], [], [], []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits[:, -1]
        step_mask = torch.cat([mask, mask.new_ones(rows, 16)], dim=1)
        for _ in range(15):  # grow the cache to prompt + 15 tokens
            token = logits.argmax(-1, keepdim=True)
            out = model(input_ids=token, attention_mask=step_mask[:, : cache.get_seq_length() + 1],
                        past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            model(input_ids=token, attention_mask=step_mask, past_key_values=cache, use_cache=True)
            forward.append(time.perf_counter() - t0)
            cache.crop(-1)  # back to prompt + 15 tokens for the next repeat
            t0 = time.perf_counter()
            torch.multinomial(torch.softmax(logits, dim=-1), 1)
            multinomial.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cdf = torch.softmax(logits.double(), dim=-1).cumsum(dim=-1)  # the one-level draw gpo had before
            torch.searchsorted(cdf, torch.rand(rows, 1, dtype=torch.float64) * cdf[:, -1:], right=True)
            one_level.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            draw(next_token_weights(logits, 1.0), torch.rand(rows, dtype=torch.float64))
            inverse.append(time.perf_counter() - t0)
    ms = lambda xs: spread([1000 * x for x in xs[1:]])  # noqa: E731 (the first call warms up)
    return [rows, ms(forward), ms(multinomial), ms(one_level), ms(inverse)]


if __name__ == "__main__":  # vLLM starts worker processes: keep the benchmark's body behind the main guard
    main()
