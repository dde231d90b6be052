"""Process start: the seconds a fresh Python spends importing what a gpo process needs before its first step (torch,
transformers' causal-LM code, gpo's engine), with gpo's lean import of transformers against a plain one.

Every `gpo run`, DDP rank, async generator and study child pays this once. transformers imports scikit-learn and
scipy whenever they are installed (mlflow installs both), and its `get_scheduler` imports peft; gpo runs none of
those code paths, so it answers transformers' availability checks for the first two and writes its own schedule.
The arms alternate in fresh interpreters.

    python bench/startup.py --repeats 7
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from harness import REPO, add_common, spread, table, write_section

ARMS = {
    "torch alone": "import torch",
    "plain transformers": (
        "import torch\n"
        "from transformers import AutoModelForCausalLM, get_scheduler\n"
        "from transformers.models.llama import modeling_llama\n"
        "import gpo.engine"
    ),
    "gpo (default)": (
        "from gpo.models import _lean_transformers\n"
        "_lean_transformers()\n"
        "from transformers import AutoModelForCausalLM\n"
        "from transformers.models.llama import modeling_llama\n"
        "import gpo.engine"
    ),
}


def seconds(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    add_common(p)
    args = p.parse_args()

    names = list(ARMS)
    for name in names:  # warm-up: the first start of each reads its files from disk
        seconds(ARMS[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            times[name].append(seconds(ARMS[name]))
    plain = times["plain transformers"]
    rows = [[name, spread(t), "-" if name == "torch alone" else spread([a - b for a, b in zip(plain, t)])]
            for name, t in times.items()]
    body = table(["imports", "s per process start", "s saved vs plain transformers"], rows)
    print(body)
    note = (f"\n\n{args.repeats} fresh interpreters per arm after a warm-up, the arms rotated; cells are median "
            "(min-max), savings paired within a repeat. 'plain transformers' imports what gpo imported before it "
            "answered transformers' scikit-learn and scipy checks and wrote its own learning-rate schedule.")
    write_section("startup", "Process start: imports before the first step", body + note, args)


if __name__ == "__main__":
    main()
