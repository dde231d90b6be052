"""Checkpoints: everything needed to resume a run exactly, written atomically, the last K kept.

A checkpoint directory holds Accelerate's state (model, optimizer, scheduler, RNG states of every rank) and
`trainer_state.json` (step, data position, allocator state, best validation score). It is written under a
temporary name and renamed when complete, so a run killed while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from gpo.errors import UserError

STATE_FILE = "trainer_state.json"
PREFIX = "step-"


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:07d}"


def save(accelerator: Any, root: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
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
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return target


def load(accelerator: Any, path: Path) -> dict[str, Any]:
    if not (path / STATE_FILE).is_file():
        raise UserError(f"`{path}` is not a gpo checkpoint (no {STATE_FILE}).")
    accelerator.load_state(str(path))
    return json.loads((path / STATE_FILE).read_text())


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories of interrupted saves are ignored)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / STATE_FILE).is_file())


def latest(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None
