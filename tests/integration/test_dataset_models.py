"""`task=dataset` with a user's TRL-style reward function inside the engine, on three model families and their
tokenizers (tests/model_zoo.py: Qwen2 with Qwen2.5's BPE, where id 0 is `!` and pad is not EOS; Llama; Gemma 3):
the function sees each completion's own text and token ids, and its scores are the step's reward component."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

import model_zoo
from gpo.config import compose

REWARDS = '''
CALLS = []


def echo(prompts, completions, completion_ids, answer, **kwargs):
    CALLS.append({"prompts": list(prompts), "completions": list(completions), "ids": [list(i) for i in completion_ids],
                  "answer": list(answer)})
    return [len(ids) / 100 for ids in completion_ids]
'''


@pytest.mark.parametrize("arch", model_zoo.ARCHITECTURES)
def test_a_user_reward_sees_each_completions_own_text_and_ids(arch, zoo, tmp_path, monkeypatch):
    from gpo.engine import Engine

    rows = [{"question": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(6)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = f"rewards_{arch}"
    (tmp_path / f"{module}.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = Engine(compose([
        f"model={zoo[arch]}", f"output_dir={tmp_path / 'runs'}", "tracker=none", "task=dataset",
        f"task.path={tmp_path / 'train.jsonl'}", "task.grader=none", "task.validation_size=2",
        f"task.rewards=[{module}:echo]", "task.reward_weights=[1.0]", "task.pass_criterion=echo",
        "algo=grpo", "pruner=none", "allocator=static", "train.questions_per_step=2", "train.group_size=2",
        "train.max_completion_length=6", "train.micro_batch_size=4", "eval.before_and_after=false",
    ]))
    metrics = engine.step()
    calls = importlib.import_module(module).CALLS
    assert len(calls) == 1 and len(calls[0]["completions"]) == 4  # one call per generation round: 2 x 2 rows
    call = calls[0]
    for text, ids in zip(call["completions"], call["ids"], strict=True):
        assert 1 <= len(ids) <= 6
        assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)  # its own tokens, no padding
    assert all(a in {r["answer"] for r in rows} for a in call["answer"])
    assert all(q.startswith("What is ") for q in call["prompts"])
    expected = sum(len(ids) for ids in call["ids"]) / 100 / 4
    assert metrics["reward/echo_mean"] == pytest.approx(expected, abs=1e-6)
    assert metrics["reward/task_mean"] == pytest.approx(expected, abs=1e-6)
    del sys.modules[module]
