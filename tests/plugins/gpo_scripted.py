"""A test-only backend that writes scripted turns instead of sampling, so multi-turn rollouts are deterministic: a
turn either calls the calculator on the question's arithmetic or answers, by a rule on the row and the turns so far.

Rules (`backend.script=`): `calculator` (even rows call the tool once, then answer with its result; odd rows answer
0 at once), `never` (every row answers at once, no call), `forever` (every turn calls the tool again), `talk` (every
turn says a number, for environments that answer turns: the row's guess walks up from 1)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from gpo.registry import register
from gpo.types import Sampling

EXPRESSION = re.compile(r"(\d+(?:\s*[-+*]\s*\d+)+)")
RESULT = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)


@dataclass(frozen=True)
class ScriptedConfig:
    script: Literal["calculator", "never", "forever", "talk"] = "calculator"
    precision: str = "float32"  # read by the composer's precision checks like a real backend's


def turn_text(script: str, prompt: str, row: int) -> str:
    """The scripted text of a turn, given everything before it (decoded, ChatML) and the row's index in its call."""
    question, _, trajectory = prompt.partition("<|im_start|>assistant")  # the system turn may show a result's layout
    results = RESULT.findall(trajectory)
    if script == "talk":
        return f"I guess {trajectory.count('I guess') + 1}."
    if script == "never" or (script == "calculator" and row % 2 == 1 and not results):
        return "<answer>0</answer>"
    if results and script == "calculator":
        return f"<answer>{results[-1]}</answer>"
    found = EXPRESSION.findall(question)
    expression = found[-1] if found else "1 + 1"
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>"


@register("backend", "scripted_turns", config=ScriptedConfig)
class ScriptedBackend:
    generates_with_policy = False
    per_prompt_counts = True

    def __init__(self, cfg: ScriptedConfig, model: Any = None, tokenizer: Any = None) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.calls: list[list[list[int]]] = []  # the prompts of every call, for tests to read

    def generate(self, prompts: list[list[int]], n: int | list[int], sampling: Sampling,
                 seed: int) -> list[list[int]]:
        counts = [n] * len(prompts) if isinstance(n, int) else list(n)
        self.calls.append(prompts)
        out = []
        for prompt, count in zip(prompts, counts, strict=True):
            text = self.tokenizer.decode(prompt, skip_special_tokens=False)
            for j in range(count):
                ids = self.tokenizer.encode(turn_text(self.cfg.script, text, j), add_special_tokens=False)
                out.append((ids + [self.tokenizer.eos_token_id])[: sampling.max_new_tokens])
        return out

    def generator_logprobs(self) -> None:
        return None

    def sync_weights(self, model: Any) -> None:
        pass

    def close(self) -> None:
        pass
