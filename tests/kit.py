"""Test kit for the foundation tests: a throw-away registry, a plug-in package on disk, running `gpo` for real.

Kept out of conftest.py (which holds the model fixtures) so the two can change independently; import what you
need: `from kit import fresh_registry, make_plugin, run_gpo_all`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpo import registry

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "tests" / "plugins"  # the toy tasks and probes that engine runs load with `plugins=[...]`


def kill_run(proc: subprocess.Popen) -> str:
    """SIGKILL a `gpo run` started in its own session, with every rank it launched, and return its output. The
    launcher starts each rank in a session of its own, so killing the launcher's group alone would leave the ranks
    holding the output pipe open (a later read would never end): they are found before the launcher dies."""
    import psutil

    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    os.killpg(proc.pid, signal.SIGKILL)
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


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty registry for the test's duration, so test components never leak into `gpo list` or other tests."""
    # Built-ins register on first import: make that happen in the real registry, not in the throw-away one.
    registry.load_builtins()
    monkeypatch.setattr(registry, "_entries", {kind: {} for kind in registry.KINDS})


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
        stdout, stderr = proc.communicate(timeout=180)
        results[key] = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    return results


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
