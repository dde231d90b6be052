"""The training pass with and without `policy/entropy`: forward + backward of `TokenLogprobs` on a randomly
initialised Llama-shaped model (SmolLM2-135M's widths and vocabulary by default), the two arms interleaved in one
process, reporting each arm's median seconds and the median (and min-max) of the per-repeat time ratio.

    python bench/entropy.py --repeats 7 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpo.logprobs import TokenLogprobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=256)
    a = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=a.layers,
                         num_attention_heads=9, num_key_value_heads=3, pad_token_id=0)
    model = LlamaForCausalLM(config).to(a.device).train()
    module = TokenLogprobs(model, share_prompt=False)
    prompt_ids = torch.randint(1, 49152, (a.rows, a.prompt_len), device=a.device)
    completion_ids = torch.randint(1, 49152, (a.rows, a.completion_len), device=a.device)
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)

    def step(with_entropy: bool) -> float:
        model.zero_grad(set_to_none=True)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = module(prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0, with_entropy=with_entropy)
        logp = out[0] if with_entropy else out
        loss = logp.mean()
        loss.backward()
        if with_entropy:
            float(out[1].mean())  # what the engine reads back, a sync included
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step(True), step(False)  # warm-up: kernels, allocator
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(a.repeats):
        for arm in ((False, True) if r % 2 == 0 else (True, False)):  # alternate which arm goes first
            times[arm].append(step(arm))
    ratios = [w / wo for w, wo in zip(times[True], times[False])]
    print(f"device={a.device} rows={a.rows} len={a.prompt_len}+{a.completion_len} layers={a.layers}")
    print(f"without entropy: median {statistics.median(times[False]):.4f} s")
    print(f"with entropy:    median {statistics.median(times[True]):.4f} s")
    print(f"ratio with/without: median {statistics.median(ratios):.4f} (min {min(ratios):.4f}, max {max(ratios):.4f},"
          f" {a.repeats} repeats)")


if __name__ == "__main__":
    main()
