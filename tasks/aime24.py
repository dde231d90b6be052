"""`aime24`: the 30 problems of AIME 2024 I and II, evaluation only (see gpo/tasks/competition.py).

Local copy: `task.data_dir=../shared/data` reads aime24/test.jsonl (QwenLM/Qwen2.5-Math's file; the same ids and
answers as the Hub dataset HuggingFaceH4/aime_2024, read by default). Answers are zero-padded ("025" = 25).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpo.registry import register
from gpo.tasks.competition import SYSTEM_PROMPT, CompetitionSet
from gpo.tasks.data import BadRows, DataDir, DataSource


@dataclass(frozen=True)
class AIME24Config:
    test: DataSource = DataSource("HuggingFaceH4/aime_2024", None, "train")
    data_dir: DataDir | None = None  # a local copy laid out like ../shared/data (aime24/test.jsonl); wins when set
    bad_rows: BadRows = "error"
    system_prompt: str = SYSTEM_PROMPT


@register("task", "aime24", config=AIME24Config)
class AIME24(CompetitionSet):
    """AIME 2024 (30 problems, whole-number answers 0-999): evaluation only, e.g. eval.tasks=[aime24]."""

    NAME = "aime24"
    LOCAL_FILE = "aime24/test.jsonl"
