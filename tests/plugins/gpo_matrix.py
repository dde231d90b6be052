"""Test-only plug-ins for the model matrix, where the reward every row deserves is known before the step runs.

- task `strict_tag`: reward 1 iff the completion ends with `<answer>GOLD</answer>`, nothing after it (GSM8K's R1
  format rule in miniature), so any text that leaks after a completion, such as decoded padding, scores 0;
- backend `scripted`: sample j of a prompt is j filler words, then the answer (wrong for every odd j), then EOS, so
  one step holds completions of different lengths, each with a known reward (mean 0.5 for an even G).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gpo.registry import register
from gpo.types import Grade, Rewards, Sampling

SYSTEM = "Reply with <answer>N</answer> and nothing after it."
QUESTION = re.compile(r"Add (\d+) and 1\.")
TAGGED = re.compile(r"<answer>(\d+)</answer>\Z")


@dataclass
class StrictTagConfig:
    size: int = 32


@register("task", "strict_tag", config=StrictTagConfig)
class StrictTagTask:
    """Reward 1 iff the completion ends with <answer>GOLD</answer> (test-only)."""

    def __init__(self, cfg: StrictTagConfig) -> None:
        self.cfg = cfg

    def load(self, split: str) -> list[dict]:
        offset = {"train": 0, "validation": 1000, "test": 2000}[split]
        return [{"question": f"Add {i + offset} and 1.", "answer": str(i + offset + 1)} for i in range(self.cfg.size)]

    def prompt(self, example: dict) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example["question"]}]

    def reward(self, completions: list[str], examples: list[dict]) -> Rewards:
        accuracy = [float(g.correct) for g in self.grade(completions, examples)]
        return Rewards(total=accuracy, components={"accuracy": accuracy})

    def grade(self, completions: list[str], examples: list[dict]) -> list[Grade]:
        grades = []
        for text, example in zip(completions, examples, strict=True):
            found = TAGGED.search(text)
            extracted = found.group(1) if found else None
            grades.append(Grade(extracted=extracted, gold=example["answer"], correct=extracted == example["answer"],
                                formatted=found is not None))
        return grades

    def close(self) -> None:
        pass  # holds nothing outside Python


def scripted_completion(gold: int, j: int) -> str:
    """The j-th sample's text: j filler words, then the answer; odd samples answer one too many."""
    return " ".join(["so"] * j + [f"<answer>{gold + j % 2}</answer>"])


@dataclass
class ScriptedConfig:
    pass


@register("backend", "scripted", config=ScriptedConfig)
class ScriptedBackend:
    """Answers `Add X and 1.` prompts with `scripted_completion(X + 1, j)` for sample j, then EOS (test-only)."""

    generates_with_policy = False  # scripted text: no forward of the policy to gather for
    per_prompt_counts = False  # one count per call

    def __init__(self, cfg: ScriptedConfig, model: Any = None, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling, seed: int) -> list[list[int]]:
        tok, out = self.tokenizer, []
        for prompt in prompts:
            gold = int(QUESTION.search(tok.decode(prompt)).group(1)) + 1
            for j in range(n):
                ids = tok.encode(scripted_completion(gold, j), add_special_tokens=False) + [tok.eos_token_id]
                assert len(ids) <= sampling.max_new_tokens, "raise train.max_completion_length for this script"
                out.append(ids)
        return out

    def generator_logprobs(self) -> None:
        return None

    def sync_weights(self, model: Any) -> None:
        pass

    def close(self) -> None:
        pass
