"""`none`: every candidate question gets its whole group of G completions (plain GRPO; the default)."""

from __future__ import annotations

from dataclasses import dataclass

from gpo.registry import register
from gpo.selectors.base import SelectorBase


@dataclass(frozen=True)
class NoneConfig:
    pass  # judges nothing, so none of the judging settings (selection/base.py) apply


@register("selector", "none", config=NoneConfig)
class NoSelection(SelectorBase):
    """Generate G completions for every question drawn (no selection before generation)."""
