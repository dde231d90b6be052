"""The tests' one shared module: what more than one test file uses lives here, and no test file imports another.

- processes: `gpo run` started in its own session (`start`), awaited (`finish`, `ended`), watched for an event
  (`until`), killed with every rank (`kill_run`); several `gpo` commands at once (`run_gpo_all`);
- what runs leave behind: the probe plug-in's records, the final weights;
- engines in this process: the tiny config, the toy engine of the async tests, a row counter;
- hand-made batches for pruners, objectives and ops; objectives built as a run builds them;
- the registry: a throw-away registry, a plug-in package on disk;
- a crowded CPU for tests whose verdicts must not depend on the machine's load (`crowded_core`);
- trackers and studies: the tracker's warnings, its JSONL fallback, MLflow's connections, a PNG that opens.

Waiting is on events (a process exits, a file appears); the only time bounds are hang guards of many minutes, which
a healthy run on a slow, busy machine never reaches and whose failure says the process hung.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from gpo import registry
from gpo.types import RolloutBatch, StepTotals

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "tests" / "plugins"  # the toy tasks, probes and faults that runs load with `plugins=[...]`
HANG_S = 900.0  # a process that has not done its part after this long is hung, not slow
POLL_S = 0.2  # how often `until` looks for the event it waits for

# --- processes --------------------------------------------------------------------------------------------------

# 4 questions x G=4, top-2 per group: 8 kept rows, 4 per rank; 2 rows per micro-batch, so each rank accumulates
# 2 micro-batches (one process: 4) before its single optimizer step. backend.batch_size=G samples one prompt per
# generate call, so a prompt's samples depend only on its global index, not on which rank drew it.
MULTI_RANK = [
    "task=toy", "plugins=[gpo_toy,gpo_probe]", "algo=grpo", "pruner=topk", "pruner.rate=0.5", "pruner.scope=group",
    "allocator=static", "train.steps=1", "train.questions_per_step=4", "train.group_size=4",
    "train.max_completion_length=8", "train.micro_batch_size=2", "backend.batch_size=4", "optim.lr=1e-3",
    "optim.warmup_ratio=0", "eval.before_and_after=false",
]


def start(args: list[str], probe: Path | None = None, env: dict[str, str] | None = None,
          launcher: list[str] | None = None, **popen: Any) -> subprocess.Popen:
    """`gpo run ARGS` with tests/plugins importable, its output (stderr too) piped; `probe`: where gpo_probe writes
    its records. Its own session, so that a test that gives up on it can stop the launcher and every rank."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
    if probe is not None:
        env["GPO_PROBE"] = str(probe)
    env.pop("WORLD_SIZE", None)
    cmd = [*(launcher or [sys.executable]), "-m", "gpo", "run", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen)


def tail(out: str | None, chars: int = 6000) -> str:
    return (out or "")[-chars:]


def ended(proc: subprocess.Popen, hang_s: float = HANG_S) -> tuple[int, str]:
    """(exit status, output) of a run once it ends. One still running after `hang_s` has hung: it is killed with
    every rank (none is left to slow the tests after it) and the test fails with its output so far."""
    try:
        out, _ = proc.communicate(timeout=hang_s)
    except subprocess.TimeoutExpired:
        out = kill_run(proc)
        pytest.fail(f"the run hung: still running after {hang_s:g} s; its output:\n{tail(out)}")
    return proc.returncode, out


def finish(proc: subprocess.Popen, hang_s: float = HANG_S) -> str:
    """The output of a run that must end and succeed (see `ended`)."""
    status, out = ended(proc, hang_s)
    assert status == 0, tail(out)
    return out


def until(done: Callable[[], bool], what: str, proc: subprocess.Popen | None = None, log: Path | None = None,
          hang_s: float = HANG_S) -> None:
    """Return as soon as `done()` holds. While `proc` runs: if it exits first, fail with its output (`log`: the file
    it writes to, when not a pipe); if neither happens within `hang_s`, it hung: kill it (kill_run) and fail."""
    for _ in range(math.ceil(hang_s / POLL_S)):
        if done():
            return
        if proc is None:
            time.sleep(POLL_S)
            continue
        try:
            proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            continue
        if done():  # it got there, then ended
            return
        said = log.read_text() if log is not None else proc.communicate()[0]
        pytest.fail(f"the process ended (status {proc.returncode}) before {what}; its output:\n{tail(said)}")
    out = kill_run(proc) if proc is not None else ""
    said = log.read_text() if log is not None else out
    pytest.fail(f"hung: still no {what} after {hang_s:g} s; its output:\n{tail(said)}")


def kill_run(proc: subprocess.Popen) -> str:
    """SIGKILL a `gpo run` started in its own session, with every rank it launched, and return its output. The
    launcher starts each rank in a session of its own, so killing the launcher's group alone would leave the ranks
    holding the output pipe open (a later read would never end): they are found before the launcher dies."""
    import psutil

    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended on its own meanwhile
        pass
    for rank in ranks:
        try:
            rank.kill()
        except psutil.NoSuchProcess:
            pass
    out, _ = proc.communicate()
    return out


def free_port() -> int:
    """A TCP port that was free a moment ago, for a gloo rendezvous of spawned ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gpo_all(commands: dict[str, tuple[list[str], list[Path]]]) -> dict[str, subprocess.CompletedProcess]:
    """Several `gpo` processes at once (each spends seconds importing torch), keyed like `commands`."""
    procs = {}
    for key, (args, pythonpath) in commands.items():
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(p) for p in pythonpath] + [env.get("PYTHONPATH", "")]).strip(
            os.pathsep
        )
        procs[key] = (args, subprocess.Popen(
            [sys.executable, "-m", "gpo", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, cwd=REPO,
        ))
    results = {}
    for key, (args, proc) in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            for _, other in procs.values():
                other.kill()
            pytest.fail(f"`gpo {' '.join(args)}` hung: still running after {HANG_S:g} s")
        results[key] = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    return results


# --- what runs leave behind -------------------------------------------------------------------------------------


def records(probe: Path, kind: str) -> list[dict]:
    """gpo_probe's records of one kind (`step`, `shard`, `tracker`, `save_pretrained`), every rank's, in order."""
    return [r for r in map(json.loads, probe.read_text().splitlines()) if r["kind"] == kind]


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


# --- engines in this process ------------------------------------------------------------------------------------

TINY = [
    "tracker=none", "task=toy", "plugins=[gpo_toy]",
    "train.questions_per_step=2", "train.group_size=4", "train.max_completion_length=8",
    "train.micro_batch_size=4", "optim.lr=1e-2", "optim.warmup_ratio=0", "eval.before_and_after=false",
]
# The async tests' runs: one micro-batch of all 8 rows per step and a constant learning rate.
SMALL = ["tracker=none", "task=toy", "plugins=[gpo_toy]", "train.group_size=4", "train.questions_per_step=2",
         "train.max_completion_length=8", "train.micro_batch_size=8", "optim.lr=1e-2", "optim.warmup_ratio=0",
         "optim.schedule=constant", "eval.before_and_after=false"]


def plugins_importable() -> None:
    """Engines built in this process load gpo_toy and friends by name."""
    if str(PLUGINS) not in sys.path:
        sys.path.insert(0, str(PLUGINS))


def tiny_config(tiny_model_path: str, tmp_path: Path, *extra: str):
    from gpo.config import compose

    plugins_importable()
    return compose([f"model={tiny_model_path}", f"output_dir={tmp_path}", *TINY, *extra])


def toy_engine(model: str, tmp_path: Path, *extra: str):
    """An Engine on the toy task (SMALL) in this process."""
    from gpo.config import compose
    from gpo.engine import Engine

    plugins_importable()
    return Engine(compose([f"model.path={model}", f"output_dir={tmp_path}", *SMALL, *extra]))


def recorded(eng) -> list:
    """The rows each step was given by the rollout source, in order (filled as the engine steps)."""
    import copy

    seen: list = []
    plain = eng.rollouts.next

    def next_step(step, timer):
        produced = plain(step, timer)
        seen.append(copy.deepcopy(produced.rows))
        return produced

    eng.rollouts.next = next_step
    return seen


class RowCounter:
    """Counts rows through every TokenLogprobs forward (old, ref and training passes) by wrapping the method."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from gpo.logprobs import TokenLogprobs

        self.rows: list[int] = []
        original = TokenLogprobs.forward

        def counted(module, prompt_ids, *args, **kwargs):
            self.rows.append(prompt_ids.shape[0])
            return original(module, prompt_ids, *args, **kwargs)

        monkeypatch.setattr(TokenLogprobs, "forward", counted)


# --- hand-made batches and objectives ---------------------------------------------------------------------------

LN2 = math.log(2.0)
# Three groups of G=4: mixed 0/1, all equal (zero variance), one outlier.
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [3.0, 1.0, 1.0, 1.0]], dtype=torch.float64)


def micro_batch(
    advantages, mask, old_logprobs=None, ref_logprobs=None, truncated=None, dtype=torch.float64
) -> RolloutBatch:
    """A RolloutBatch holding only what objectives read: advantages [n], masks [n, L], optional log-probs."""
    mask = torch.as_tensor(mask, dtype=torch.long)  # [n, L]
    n, length = mask.shape

    def as_float(x):
        return None if x is None else torch.as_tensor(x, dtype=dtype)

    return RolloutBatch(
        prompt_ids=torch.ones(n, 1, dtype=torch.long),  # [n, 1]
        prompt_mask=torch.ones(n, 1, dtype=torch.long),  # [n, 1]
        completion_ids=torch.ones(n, length, dtype=torch.long),  # [n, L]
        completion_mask=mask,
        group_ids=torch.zeros(n, dtype=torch.long),  # [n]
        rewards=torch.zeros(n, dtype=dtype),  # [n]
        advantages=as_float(advantages),
        truncated=torch.zeros(n, dtype=torch.bool) if truncated is None else torch.as_tensor(truncated),
        owner_rank=torch.zeros(n, dtype=torch.long),  # [n]
        old_logprobs=as_float(old_logprobs),
        ref_logprobs=as_float(ref_logprobs),
    )


def make_batch(advantages, group_size, owner_rank=None, tokens=None, pad=0, first_group=0, first_prompt=7):
    """N = len(advantages) rows in groups of `group_size`; row i's completion is [tokens[i]] (default 100 + i),
    followed by `pad` extra padding columns; question q's prompt is the one token first_prompt + q."""
    adv = torch.tensor(advantages, dtype=torch.float32)  # [N]
    n = len(adv)
    tokens = list(range(100, 100 + n)) if tokens is None else tokens
    completion_ids = torch.zeros(n, 1 + pad, dtype=torch.long)  # [N, L]
    completion_ids[:, 0] = torch.tensor(tokens)
    completion_mask = torch.zeros(n, 1 + pad, dtype=torch.long)  # [N, L]
    completion_mask[:, 0] = 1
    question = torch.arange(n) // group_size  # [N]
    return RolloutBatch(
        prompt_ids=(question + first_prompt).reshape(n, 1),  # [N, 1]
        prompt_mask=torch.ones(n, 1, dtype=torch.long),  # [N, 1]
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        group_ids=question + first_group,
        rewards=adv.clone(),
        advantages=adv,
        truncated=torch.zeros(n, dtype=torch.bool),
        owner_rank=torch.zeros(n, dtype=torch.long) if owner_rank is None else torch.tensor(owner_rank),
    )


# The fixed step of the multi-rank helpers' tests: 4 questions x G=4, with ties (zero-variance group 1, repeated |A|
# elsewhere).
FULL_ADV = [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 1.0, -1.0, 0.2, -0.9, 0.9, -0.2]
FULL_G = 4


def full_batch() -> RolloutBatch:
    return make_batch(FULL_ADV, FULL_G)


def build_objective(name: str, max_completion_length: int | None = 8, **cfg):
    """The objective as a run builds it: its settings validated against the config class's annotations (as the
    composer validates them; a bad value raises pydantic's ValidationError here), then the constructor."""
    from pydantic import TypeAdapter

    registry.load_builtins()
    entry = registry.get("algo", name)
    return entry.build(TypeAdapter(entry.config).validate_python(cfg), max_completion_length=max_completion_length)


def assert_micro_batches_sum_to_the_step(objective, seed: int) -> dict:
    """Three uneven micro-batches (each re-trimmed, as the engine does) give the whole batch's loss and metrics:
    shares summed, `_min`/`_max` metrics reduced by their name. Returns the whole batch's metrics."""
    gen = torch.Generator().manual_seed(seed)
    n, length = 6, 5
    mask = (torch.arange(length) < torch.tensor([5, 1, 2, 5, 3, 4]).unsqueeze(1)).long()  # [N, L]
    old = -torch.rand(n, length, generator=gen, dtype=torch.float64)
    logp = old + 0.3 * torch.randn(n, length, generator=gen, dtype=torch.float64)
    batch = micro_batch(torch.randn(n, generator=gen, dtype=torch.float64), mask, old_logprobs=old,
                        ref_logprobs=old.flip(1))
    totals = StepTotals(sequences=n, tokens=int(objective.loss_mask(batch).sum()))
    whole, whole_m = objective.loss(logp, batch, totals)
    parts = []
    for rows in (torch.arange(0, 2), torch.arange(2, 3), torch.arange(3, 6)):
        mb = batch.select(rows)  # re-trims padding to the micro-batch's longest row, as the engine does
        parts.append(objective.loss(logp[rows, : mb.completion_mask.shape[1]], mb, totals))
    assert sum(p[0] for p in parts).item() == pytest.approx(whole.item(), abs=1e-12)
    for key, value in whole_m.items():
        if key.endswith("_min"):
            reduced = min(p[1][key] for p in parts)
        elif key.endswith("_max"):
            reduced = max(p[1][key] for p in parts)
        else:
            reduced = sum(p[1][key] for p in parts)
        assert reduced.item() == pytest.approx(value.item(), abs=1e-12), key
    return whole_m


# --- the registry and plug-ins ----------------------------------------------------------------------------------


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty registry for the test's duration, so test components never leak into `gpo list` or other tests."""
    # Built-ins register on first import: make that happen in the real registry, not in the throw-away one.
    registry.load_builtins()
    monkeypatch.setattr(registry, "_entries", {kind: {} for kind in registry.KINDS})


PLUGIN_SOURCE = '''\
"""A pruner from outside gpo, registered the way a user's package would do it."""
from dataclasses import dataclass

import torch

from gpo.pruners.ranking import top_up
from gpo.registry import register


@dataclass
class EveryOtherConfig:
    offset: int = 0


@register("pruner", "{name}", config=EveryOtherConfig)
class EveryOther:
    """Keep every second completion (a test plug-in)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def keep(self, batch, multiple_of=1):
        mask = (torch.arange(len(batch)) + self.cfg.offset) % 2 == 0  # [N]
        return top_up(mask, torch.arange(len(batch), dtype=torch.float32), multiple_of)

    def expected_kept_per_group(self, group_size):
        return group_size / 2
'''


def make_plugin(root: Path, module: str, pruner: str, entry_point: bool = True) -> Path:
    """Write `module.py` registering pruner `pruner` under `root`; with `entry_point`, also an installed
    distribution's metadata (`*.dist-info/entry_points.txt`) declaring it in the `gpo.plugins` group, which is
    exactly what pip leaves behind for `[project.entry-points."gpo.plugins"]`. Returns `root`, the path to import from.
    """
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(PLUGIN_SOURCE.replace("{name}", pruner))
    if entry_point:
        dist = root / f"{module}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[gpo.plugins]\n{pruner} = {module}\n")
    return root


# --- a crowded CPU ----------------------------------------------------------------------------------------------

SPIN = "while True: pass"


@contextmanager
def crowded_core(pids: Iterable[int] = (), spinners: int = 3) -> Iterator[None]:
    """Share one core between `spinners` busy-looping processes, the calling thread (and threads it starts) and the
    processes `pids` (their children too, once started), until the block ends: whatever those compute gets a
    fraction of a core however many cores the machine has, so a bound that counts wall time would be overrun.

    Where CPU affinity cannot be set (not Linux), the spinners run unpinned instead, one per core plus `spinners`.
    At the end the spinners are killed and every process this one started gets back this thread's CPUs.
    """
    pin = hasattr(os, "sched_setaffinity")
    allowed = os.sched_getaffinity(0) if pin else set()
    count = spinners + (0 if pin else (os.cpu_count() or 1))
    busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        if pin:
            core = {min(allowed)}
            for pid in [*(p.pid for p in busy), *pids]:
                os.sched_setaffinity(pid, core)
            os.sched_setaffinity(0, core)  # this thread only (Linux); threads started inside the block inherit it
        yield
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait()
        if pin:
            os.sched_setaffinity(0, allowed)
            _restore_children(allowed)


def _restore_children(allowed: set[int]) -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.cpu_affinity(sorted(allowed))
        except psutil.Error:  # gone meanwhile
            pass


# --- trackers and studies ---------------------------------------------------------------------------------------

TRACKED_CONFIG_YAML = "optim:\n  lr: 1.0e-05\nseed: 42\n"  # the config text a test tracker logs as an artifact


def warnings_from_tracker(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "gpo.tracking" and r.levelno == logging.WARNING]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def mlflow_connections(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The address of every TCP connection MLflow's HTTP client (urllib3) opens, retries included, in order."""
    import urllib3.util.connection as connection

    opened: list[tuple] = []
    plain = connection.create_connection

    def counted(address, *args, **kwargs):
        opened.append(address)
        return plain(address, *args, **kwargs)

    monkeypatch.setattr(connection, "create_connection", counted)
    return opened


def assert_png(path: Path) -> None:
    """`path` is a PNG image that opens, of a plot's size."""
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size[0] > 100 and image.size[1] > 100
