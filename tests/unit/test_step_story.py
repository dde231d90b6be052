"""The step is told once: docs/architecture.md ("The step": its list and its one diagram), the rollout's loop and
`Engine.step` name the same phases in the same order, so the three tellings cannot drift apart. Read from the
source text, nothing imported or run."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASES = ["plan", "rounds", "rewards", "score", "prune", "refill", "shard", "log-probs", "update", "metrics"]
ROLLOUT_PHASES, ENGINE_PHASES = PHASES[:6], PHASES[6:]


def step_section() -> str:
    """docs/architecture.md from "## The step" to the next second-level heading (its subsections included)."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = text.index("\n## The step\n")
    return text[start:text.index("\n## ", start + 1)]


def phase_comments(source: str) -> list[str]:
    """The phases named by comments of the form `# phase: why`, in source order."""
    return re.findall(r"^\s*# ([a-z][a-z_-]*):", source, re.MULTILINE)


def function_source(path: str, qualname: str) -> str:
    """The source text of `Class.method` in the repository file `path`."""
    text = (REPO / path).read_text(encoding="utf-8")
    class_name, method = qualname.split(".")
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return ast.get_source_segment(text, item) or ""
    raise AssertionError(f"{qualname} is not in {path}")


def test_the_doc_lists_the_phases_in_order():
    listed = re.findall(r"^- \*\*([a-z][a-z-]*)\*\*:", step_section(), re.MULTILINE)
    assert listed == PHASES


def test_the_doc_has_one_diagram_with_a_node_per_phase_in_order():
    blocks = re.findall(r"```mermaid\n(.*?)```", step_section(), re.DOTALL)
    assert len(blocks) == 1, "one diagram of the step"
    diagram = blocks[0]
    assert diagram.startswith("flowchart TD\n")
    assert "<" not in diagram, "plain mermaid: no HTML in labels"
    # node definitions: id["phase: ..."] or id{"phase: ..."}; edge labels (|"..."|) are not nodes
    labels = re.findall(r"^\s*\w+\s*[\[{]\"([a-z][a-z-]*)[:\"]", diagram, re.MULTILINE)
    assert labels == PHASES


def test_the_rollout_and_the_engine_name_the_phases_in_order():
    rollout = phase_comments(function_source("gpo/rollout.py", "StepRollout.__iter__"))
    engine = phase_comments(function_source("gpo/engine.py", "Engine.step"))
    assert rollout == ROLLOUT_PHASES
    assert engine == ENGINE_PHASES
    assert phase_comments(function_source("gpo/rollout.py", "Rollout.produce")) == ["prune"]


def test_phase_comments_are_read_in_source_order():
    # the reader the checks above rely on: out-of-order or renamed phases come back as written
    source = "def step():\n    # shard: rows\n    x = 1  # plan: not a phase comment\n    # log_probs: old\n"
    assert phase_comments(source) == ["shard", "log_probs"]
    assert phase_comments("    # logprobs: old\n    # rounds: calls\n") == ["logprobs", "rounds"]
