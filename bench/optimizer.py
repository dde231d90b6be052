"""The optimizer step on its own: torch's AdamW as a per-tensor loop, as foreach, and fused (gpo's default,
`optim.fused`), on the default model's parameters with random gradients, alternated in one process.

The step is a fixed cost of every training step, whatever P is: pruning cannot shrink it, so it caps CPPO's
speedup below Amdahl's bound (bench/steps.py). Also times gradient clipping, the other fixed cost of the update.

    python bench/optimizer.py --repeats 5
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from harness import add_common, spread, table, write_section

IMPLEMENTATIONS: dict[str, dict[str, Any]] = {  # AdamW keyword arguments
    "loop": {"foreach": False}, "foreach": {"foreach": True}, "fused (default)": {"fused": True}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=5)
    add_common(p)
    args = p.parse_args()

    import torch

    from gpo.config import compose
    from gpo.models import load_policy

    model = load_policy(compose([f"model.path={args.model}", "tracker=none", *args.set]).model)
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    optimizers = {name: torch.optim.AdamW(params, lr=0.0, **kw) for name, kw in IMPLEMENTATIONS.items()}
    for opt in optimizers.values():  # warm-up: creates the moment buffers
        opt.step()
    seconds: dict[str, list[float]] = {name: [] for name in [*optimizers, "clip_grad_norm_"]}
    for _ in range(args.repeats):
        for name, opt in optimizers.items():
            t0 = time.perf_counter()
            opt.step()
            seconds[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1e9)
        seconds["clip_grad_norm_"].append(time.perf_counter() - t0)
    loop = seconds["loop"]
    rows = [[name, spread(s), "-" if name == "clip_grad_norm_" else spread([a / b for a, b in zip(loop, s)])]
            for name, s in seconds.items()]
    body = table(["", "s per call", "speedup vs loop"], rows)
    print(body)
    note = (f"\n\n{args.model}: {sum(q.numel() for q in params) / 1e6:.0f}M parameters in {len(params)} tensors, "
            f"float32; lr 0 (the same work, the weights stay put); {args.repeats} repeats after a warm-up, the "
            "implementations alternated; cells are median (min-max), speedups paired within a repeat.")
    write_section("optimizer", "Optimizer step: AdamW implementations", body + note, args)


if __name__ == "__main__":
    main()
