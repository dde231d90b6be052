"""A test-only task that fails while a marker file exists (a study run that fails, then succeeds when resumed), or
unless an environment variable is set (a run that only works where a launcher such as Ray started it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gpo.registry import register
from gpo_toy import ToyConfig, ToyTask


@dataclass
class FlakyConfig(ToyConfig):
    marker: str = ""  # while this file exists, loading the train split fails
    need_env: str = ""  # loading the train split fails unless this environment variable is set


@register("task", "flaky", config=FlakyConfig)
class FlakyTask(ToyTask):
    """The toy task, failing to load its train split while `marker` exists (test-only)."""

    def load(self, split: str) -> list[dict]:
        if split == "train" and self.cfg.marker and Path(self.cfg.marker).exists():
            raise RuntimeError(f"flaky: {self.cfg.marker} exists")
        if split == "train" and self.cfg.need_env and self.cfg.need_env not in os.environ:
            raise RuntimeError(f"flaky: {self.cfg.need_env} is not set")
        return super().load(split)
