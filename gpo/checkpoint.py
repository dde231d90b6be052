"""Checkpoints: everything needed to resume a run exactly, written atomically, verified before loading, the last K kept.

A checkpoint directory holds Accelerate's state (model, optimizer, scheduler, RNG states of every rank),
`trainer_state.json` (step, data position, allocator state, best validation score), with train.max_staleness >= 1
`rollout_queue.pt` (generated steps not yet trained, gpo/async_rollout.py) and, written last,
`manifest.json`: the size in bytes of every other file. It is written under a temporary name, flushed to disk and
renamed when complete, so a run killed while saving leaves the previous checkpoint intact.

"Complete" means: the manifest parses and every file it lists exists with exactly its recorded size. That catches
what actually happens to checkpoints (a full disk, a copy or sync cut short, files never flushed before a crash)
without reading gigabytes to hash them; damage that keeps the sizes shows up when loading fails, and the engine
then falls back to the previous complete checkpoint too. Checkpoints written before manifests existed are taken as
they are. A checkpoint that fails to load gets a `damaged.txt` saying why, so later resumes skip it at once
(delete that file to try it again). gpo never deletes a checkpoint because it looks damaged: it skips it, says so,
and when the same step is saved again moves the damaged directory aside (`step-N.incomplete`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from gpo.errors import UserError

STATE_FILE = "trainer_state.json"
QUEUE_FILE = "rollout_queue.pt"
MANIFEST = "manifest.json"
DAMAGED = "damaged.txt"
PREFIX = "step-"
NAME = re.compile(rf"{PREFIX}\d+")


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:07d}"


def save(accelerator: Any, root: Path, step: int, state: dict[str, Any], keep_last: int,
         queued: list[Any] | None = None) -> Path:
    target = checkpoint_dir(root, step)
    tmp = target.with_name(f".{target.name}.tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=False)  # tied embeddings: safetensors refuses shared storage
    accelerator.wait_for_everyone()  # every rank writes its own RNG state (and ZeRO shards) before the rename
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=2))
        if queued:
            torch.save(queued, tmp / QUEUE_FILE)
        write_manifest(tmp)
        if target.exists():
            _replace(target)
        tmp.rename(target)
        _fsync(root)  # the rename itself reaches the disk
        complete = [p for p in list_checkpoints(root) if not problems(p)]
        for old in complete[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return target


def write_manifest(directory: Path) -> None:
    """Flush every file of `directory` to disk, then record their sizes in the manifest (the last file written)."""
    sizes = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        _fsync(path)
        sizes[path.relative_to(directory).as_posix()] = path.stat().st_size
    manifest = directory / MANIFEST
    manifest.write_text(json.dumps({"files": sizes}, indent=1))
    _fsync(manifest)
    _fsync(directory)


def problems(path: Path) -> list[str]:
    """Why `path` is not a complete checkpoint; empty when it is."""
    if not (path / STATE_FILE).is_file():
        return [f"no {STATE_FILE}"]
    if (path / DAMAGED).is_file():
        return [f"it failed to load before: {(path / DAMAGED).read_text().strip()}"]
    if (path / MANIFEST).is_file():
        try:
            sizes = json.loads((path / MANIFEST).read_text())["files"]
        except (ValueError, KeyError, TypeError, OSError) as exc:
            return [f"{MANIFEST} is unreadable ({exc})"]
        found = []
        for name, size in sizes.items():
            file = path / name
            if not file.is_file():
                found.append(f"{name} is missing")
            elif file.stat().st_size != size:
                found.append(f"{name} has {file.stat().st_size} bytes, {size} were written")
        if found:
            return found
    try:
        json.loads((path / STATE_FILE).read_text())
    except (ValueError, OSError) as exc:
        return [f"{STATE_FILE} is unreadable ({exc})"]
    return []


def load(accelerator: Any, path: Path) -> dict[str, Any]:
    """Load a checkpoint that `problems` found complete. Raises what the loaders raise on damaged files."""
    if not (path / STATE_FILE).is_file():
        raise UserError(f"`{path}` is not a gpo checkpoint (no {STATE_FILE}).")
    accelerator.load_state(str(path))
    state = json.loads((path / STATE_FILE).read_text())
    queue = path / QUEUE_FILE
    state["queued"] = torch.load(queue, weights_only=False) if queue.is_file() else []  # gpo's own objects
    return state


def mark_damaged(path: Path, reason: str) -> None:
    """Record in the checkpoint itself that it failed to load, and why (nothing else in it is touched)."""
    (path / DAMAGED).write_text(reason + "\n")


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories, oldest first, complete or not (temporary and moved-aside directories excluded)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and NAME.fullmatch(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=step_of)


def step_of(path: Path) -> int:
    """The step a checkpoint directory was saved after, from its name."""
    return int(path.name[len(PREFIX):])


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (newer incomplete ones are skipped silently; see `candidates`)."""
    found = [p for p in list_checkpoints(root) if not problems(p)]
    return found[-1] if found else None


def candidates(root: Path, say: Any) -> list[Path]:
    """Complete checkpoints under `root`, newest first; `say` is told about each incomplete one skipped."""
    out = []
    for path in reversed(list_checkpoints(root)):
        found = problems(path)
        if found:
            say(f"checkpoint {path} is incomplete ({'; '.join(found[:3])}); skipped, left in place")
        else:
            out.append(path)
    return out


def _replace(target: Path) -> None:
    """Make room for a new checkpoint of the same step: an older complete one goes (the run redid that step), a
    damaged one is moved aside, never deleted."""
    if not problems(target):
        shutil.rmtree(target)
        return
    n, aside = 1, target.with_name(f"{target.name}.incomplete")
    while aside.exists():
        n += 1
        aside = target.with_name(f"{target.name}.incomplete-{n}")
    target.rename(aside)
    print(f"gpo: moved the incomplete checkpoint {target} aside to {aside}", flush=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
