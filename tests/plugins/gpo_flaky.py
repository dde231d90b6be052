"""A test-only task that fails while a marker file exists: a study run that fails, then succeeds when resumed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpo.registry import register
from gpo_toy import ToyConfig, ToyTask


@dataclass
class FlakyConfig(ToyConfig):
    marker: str = ""  # while this file exists, loading the train split fails


@register("task", "flaky", config=FlakyConfig)
class FlakyTask(ToyTask):
    """The toy task, failing to load its train split while `marker` exists (test-only)."""

    def load(self, split: str) -> list[dict]:
        if split == "train" and self.cfg.marker and Path(self.cfg.marker).exists():
            raise RuntimeError(f"flaky: {self.cfg.marker} exists")
        return super().load(split)
