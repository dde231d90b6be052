"""`amc23`: the 40 problems of AMC 12 2023 A and B, evaluation only (see gpo/tasks/competition.py).

Local copy: `task.data_dir=DIR` reads amc23/test.jsonl (QwenLM/Qwen2.5-Math's file, in the layout of
the Hub dataset math-ai/amc23, read by default).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpo.registry import register
from gpo.tasks.competition import CompetitionConfig, CompetitionSet
from gpo.tasks.data import DataSource


@dataclass(frozen=True)
class AMC23Config(CompetitionConfig):
    test: DataSource = DataSource("math-ai/amc23", None, "test")


@register("task", "amc23", config=AMC23Config)
class AMC23(CompetitionSet):
    """AMC 12 2023 (40 problems, whole-number answers): evaluation only, e.g. eval.tasks=[amc23]."""

    NAME = "amc23"
    LOCAL_FILE = "amc23/test.jsonl"
