"""Experiment trackers (`tracker=`). `none` does nothing: dry runs, tests and non-zero ranks use it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpo.registry import register


@dataclass
class NullConfig:
    pass


@register("tracker", "none", config=NullConfig)
class NullTracker:
    """Log nothing (the null object for optional tracking)."""

    def __init__(self, cfg: NullConfig | None = None, **_: Any) -> None:
        self.cfg = cfg

    def start(self, run_name: str, params: dict[str, Any], config_yaml: str) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str) -> None:
        pass

    def end(self, status: str = "FINISHED") -> None:
        pass
