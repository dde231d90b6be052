"""What every benchmark script shares: building an engine, peak memory of a child process, tables, and writing
its own section of docs/benchmarks.md (with the command that produced it and the date).

Scripts import it as `from harness import ...` (they run as `python bench/NAME.py`, so bench/ is on sys.path).
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

# Each arm names the precision it measures: `auto` means float32 in benchmarks, so that a recorded command
# measures the same arms on machines with and without bfloat16 instructions.
os.environ.setdefault("GPO_AUTO_PRECISION", "float32")

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
DOC_HEADER = """# Benchmarks

Every section below is written by the script it names (`bench/*.py`), with the exact command and the date.
Machine: 2 CPU cores shared with other jobs, so timings are noisy; each script interleaves its configurations
(A, B, A, B, ...) so that load from other jobs hits every arm alike, and states its repeat count and spread.
Nothing here is typed in by hand except the text outside the generated sections.
"""


def engine(*overrides: str):
    """An Engine on the embedded default model and task, tracking nothing, writing into a temporary directory."""
    from gpo.config import compose
    from gpo.engine import Engine

    out = tempfile.mkdtemp(prefix="gpo-bench-")
    return Engine(compose(["tracker=none", f"output_dir={out}", "eval.before_and_after=false", *overrides]))


def set_lr(eng, lr: float) -> None:
    """The learning rate of a built engine's next steps, on the optimizer and on the schedule's base rates (the
    schedule multiplies those each step, so setting the optimizer's alone would last one step)."""
    eng.scheduler.base_lrs = [lr for _ in eng.scheduler.base_lrs]
    for group in eng.optimizer.param_groups:
        group["lr"] = lr


def freeze_weights(eng) -> None:
    """Learning rate 0 on a built engine: every step still does all its work (gradients, an AdamW update) but the
    weights stay put. A run config refuses optim.lr=0 (a user's run would train nothing), so benchmarks set it here."""
    set_lr(eng, 0.0)


def replayed_steps(eng, arms: list, repeats: int, setup: Callable[[Any], None]) -> dict[Any, list[dict]]:
    """One engine steps every arm on the same questions: before each arm's step (after `setup(arm)` swaps its
    parts in) the question stream and step counter are rewound, so every arm draws the same questions with the same
    seeds. The arms' order rotates from repeat to repeat (a step's speed depends on the step before it in the
    process); repeat 0 warms every arm up and is not returned. Each arm's step metrics, one dict per repeat."""
    runs: dict[Any, list[dict]] = {arm: [] for arm in arms}
    for repeat in range(repeats + 1):
        start = (eng.questions.state_dict(), eng.step_index)
        for arm in arms[repeat % len(arms):] + arms[: repeat % len(arms)]:
            setup(arm)
            eng.questions.load_state_dict(start[0])
            eng.step_index = start[1]
            metrics = eng.step()
            if repeat:
                runs[arm].append(metrics)
        eng.questions.load_state_dict(start[0])  # the next repeat draws the questions after these
        eng.questions.take(eng.train_cfg.questions_per_step)
        eng.step_index = start[1] + 1
    return runs


def add_common(parser) -> None:
    """Options every benchmark takes: config overrides for each engine it builds, e.g. `--set model.dtype=bfloat16`
    (bench/gpu_check.sh runs the benchmarks on a random-weight model that way), and --no-write."""
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra config overrides for every engine, after the script's own")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(script: str, *args: str, timeout: float = 900) -> dict:
    """Run `python bench/<script> --child ARGS` in a fresh process (a clean peak RSS); it prints one JSON line last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "bench"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), "--child", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    """Median with (min-max) over repeats, the way every table states its noise."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (also readable as plain text on the terminal)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(key: str, title: str, body: str, args, variant: str = "") -> None:
    """Replace (or append) this script's section of docs/benchmarks.md; other sections are left as they are.
    `args` carries the options of `add_common`: with --no-write nothing is written (a trial run at tiny sizes must
    not overwrite measured figures), and a run with --set overrides, or a script's own `variant` (other sizes or
    arms than its defaults), gets a section of its own beside the default."""
    if args.no_write:
        return
    variant = " ".join([*args.set, variant]).strip()
    if variant:
        key, title = f"{key} {variant}", f"{title} ({variant})"
    command = "python " + " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    section = (f"<!-- bench:{key} -->\n## {title}\n\n`{command}` ({date.today().isoformat()}, "
               f"torch {_torch_version()}, {os.cpu_count()} cores of {_cpu_model()})\n\n{body.strip()}\n"
               f"<!-- /bench:{key} -->")
    text = DOC.read_text() if DOC.exists() else DOC_HEADER
    pattern = re.compile(rf"<!-- bench:{re.escape(key)} -->.*?<!-- /bench:{re.escape(key)} -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"\nwrote section `{key}` of {DOC.relative_to(REPO)}")


def _cpu_model() -> str:
    """The CPU's model name and torch's capability on it (AVX2, AVX512, AMX...): figures move with both."""
    import platform

    import torch

    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:  # the first processor's lines; later ones repeat them
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name, flags = fields.get("model name") or platform.processor() or "unknown CPU", fields.get("flags", "")
    extras = [label for flag, label in (("avx512_bf16", "AVX-512 BF16"), ("amx_bf16", "AMX")) if flag in flags.split()]
    return ", ".join([name, torch.backends.cpu.get_cpu_capability(), *extras])


def _torch_version() -> str:
    import torch

    return torch.__version__
