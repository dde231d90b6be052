"""`aime24`: the 30 problems of AIME 2024 I and II, evaluation only (see gpo/tasks/competition.py).

Local copy: `task.data_dir=DIR` reads aime24/test.jsonl (QwenLM/Qwen2.5-Math's file; the same ids and
answers as the Hub dataset HuggingFaceH4/aime_2024, read by default). Answers are zero-padded ("025" = 25).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpo.registry import register
from gpo.tasks.competition import CompetitionConfig, CompetitionSet
from gpo.tasks.data import DataSource


@dataclass(frozen=True)
class AIME24Config(CompetitionConfig):
    test: DataSource = DataSource("HuggingFaceH4/aime_2024", None, "train")


@register("task", "aime24", config=AIME24Config)
class AIME24(CompetitionSet):
    """AIME 2024 (30 problems, whole-number answers 0-999): evaluation only, e.g. eval.tasks=[aime24]."""

    NAME = "aime24"
    LOCAL_FILE = "aime24/test.jsonl"
