"""Multi-turn trajectories (gpo/agent.py) with a scripted backend: how turns, tool results and an environment's
replies become one row's tokens and masks, the limits that end a trajectory, and what the rewards read."""

from __future__ import annotations

import json

import pytest
import torch

from gpo.agent import LIMIT_REACHED, Agent, Turns, build_agent, roll_out, score_trajectories
from gpo.generation import generate
from gpo.run_config import AgentOptions
from gpo.types import Rewards, Sampling
from kit import plugins_importable

plugins_importable()
from gpo_scripted import ScriptedBackend, ScriptedConfig  # noqa: E402  (a test plug-in, found on its path)

QUESTIONS = [{"question": "What is 12 * 34?", "answer": "408"}, {"question": "What is 7 + 5?", "answer": "12"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def conversations():
    return [[{"role": "user", "content": q["question"]}] for q in QUESTIONS]


def agent_for(**options) -> Agent:
    agent = build_agent(AgentOptions(**{"tools": ("calculator",), **options}))
    assert agent is not None
    return agent


def rolled(tokenizer, script="calculator", n=2, max_new_tokens=200, **options):
    agent = agent_for(**options)
    try:
        backend = ScriptedBackend(ScriptedConfig(script=script), tokenizer=tokenizer)
        turns = Turns(tokenizer, agent.schemas)
        out = roll_out(agent, turns, backend, QUESTIONS, conversations(), n, Sampling(max_new_tokens), seed=3,
                       max_prompt_length=512)
        return out, backend, turns
    finally:
        agent.close()


def test_no_options_no_agent():
    assert build_agent(AgentOptions()) is None
    assert build_agent(object()) is None  # a plug-in task's config without the options


def test_smollm2s_template_gets_the_tools_in_its_system_turn(tokenizer):
    agent = agent_for()
    agent.close()
    turns = Turns(tokenizer, agent.schemas)
    assert not turns.native  # SmolLM2's template ignores `tools=`
    prompt = tokenizer.decode(turns.encode(conversations()[:1], 512)[0])
    assert "calculator" in prompt and "<tool_call>" in prompt and prompt.index("calculator") < prompt.index("12 * 34")
    inserted = tokenizer.decode(turns.inserted(turns.tool_turns([_result("calculator", "408")])))
    assert inserted == "\n<|im_start|>tool\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


# A template that renders tools and tool turns itself (written for this test, Qwen2.5-like in spirit).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<result>{{ m['content'] }}"
    "</result><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_renders_tools_is_used_as_it_is(tokenizer):
    agent = agent_for()
    agent.close()
    tok = _with_template(tokenizer, TOOL_TEMPLATE)
    turns = Turns(tok, agent.schemas)
    assert turns.native
    prompt = tok.decode(turns.encode(conversations()[:1], 512)[0])
    assert prompt.startswith("<|im_start|>system\nTOOLS: calculator<|im_end|>")
    inserted = tok.decode(turns.inserted(turns.tool_turns([_result("calculator", "408")])))
    assert inserted == "\n<|im_start|>user\n<result>408</result><|im_end|>\n<|im_start|>assistant\n"


def test_a_tool_call_its_result_and_the_answer_are_one_row(tokenizer):
    out, backend, turns = rolled(tokenizer)
    batch, rows = out.batch, out.rows
    assert len(batch) == 4 and batch.group_ids.tolist() == [0, 0, 1, 1]
    calling, direct = rows[0], rows[1]
    assert [t["role"] for t in calling.turns] == ["assistant", "tool", "assistant"]
    assert json.loads(calling.turns[0]["content"].split("<tool_call>")[1].split("</tool_call>")[0]) == {
        "name": "calculator", "arguments": {"expression": "12 * 34"}}
    assert "408" in calling.turns[1]["content"] and calling.answer == "<answer>408</answer>"
    assert direct.answer == "<answer>0</answer>" and [t["role"] for t in direct.turns] == ["assistant"]
    # the row's tokens: model turn, inserted turn, model turn; the masks split them exactly
    eos = tokenizer.eos_token_id
    first = tokenizer.encode(calling.turns[0]["content"], add_special_tokens=False) + [eos]
    inserted = turns.inserted(turns.tool_turns([_result("calculator", "408")]))
    last = tokenizer.encode("<answer>408</answer>", add_special_tokens=False) + [eos]
    width = len(first) + len(inserted) + len(last)
    assert batch.completion_ids[0, :width].tolist() == first + inserted + last
    expected_tool = torch.tensor([0] * len(first) + [1] * len(inserted) + [0] * len(last), dtype=torch.bool)
    assert torch.equal(batch.tool_tokens[0, :width], expected_tool)
    assert torch.equal(batch.completion_mask[0, :width].bool(), ~expected_tool)
    assert int(batch.lengths[0]) == len(first) + len(last)  # model tokens only
    assert not batch.tool_tokens[0, width:].any() and not batch.attended[0, width:].any()
    assert batch.truncated.tolist() == [False] * 4
    # the second turn was generated from the whole trajectory so far
    assert backend.calls[1][0] == calling.prompt + first + inserted
    metrics = out.metrics(["calculator"])
    assert metrics["tool/calls"] == 2 and metrics["tool/calling"] == 2 and metrics["tool/calls/calculator"] == 2
    assert metrics["tool/turns"] == 6 and metrics["tool/failures"] == 0
    other = turns.inserted(turns.tool_turns([_result("calculator", "12")]))  # 7 + 5, the second question
    assert metrics["tool/tool_tokens"] == len(inserted) + len(other)


def test_without_a_call_the_row_is_the_single_turn_rows(tokenizer):
    out, _, turns = rolled(tokenizer, script="never")
    prompts = turns.encode(conversations(), 512)
    plain = generate(ScriptedBackend(ScriptedConfig(script="never"), tokenizer=tokenizer), prompts, 2,
                     Sampling(200), 3, tokenizer.eos_token_id, tokenizer.pad_token_id)
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "group_ids", "truncated"):
        assert torch.equal(getattr(out.batch, name), getattr(plain, name)), name
    assert not out.batch.tool_tokens.any()
    assert torch.equal(out.batch.attended, plain.completion_mask)


def test_the_budget_counts_inserted_tokens_and_ends_a_trajectory_that_cannot_go_on(tokenizer):
    full, _, _ = rolled(tokenizer, n=1)
    first_turn = len(full.rows[0].turns[0]["content"])  # enough for the call, not for its result and an answer
    out, _, _ = rolled(tokenizer, n=1, max_new_tokens=int(full.batch.lengths[0]) - 3)
    row = out.rows[0]
    assert first_turn and row.truncated and len(row.tokens) <= int(full.batch.lengths[0]) - 3
    assert out.batch.truncated[0]


def test_calls_over_the_limit_get_an_error_and_turns_stop_at_max_turns(tokenizer):
    out, _, _ = rolled(tokenizer, script="forever", n=1, max_new_tokens=1000, max_tool_calls=2, max_turns=4)
    row = out.rows[0]
    assert row.model_turns == 4 and row.truncated  # still calling when no turn was left
    results = [t["content"] for t in row.turns if t["role"] == "tool"]
    assert len(results) == 3 and "408" in results[0] and "408" in results[1]
    assert json.loads(LIMIT_REACHED)["error"] in results[2]
    assert sum(row.calls.values()) == 3 and row.failures == 1


def test_the_reward_reads_the_last_turn_and_a_task_may_take_the_turns(tokenizer):
    out, _, _ = rolled(tokenizer, n=1)
    seen = {}

    class Task:
        def reward(self, completions, examples, trajectories=None):
            seen["completions"], seen["trajectories"] = completions, trajectories
            return Rewards(total=[1.0] * len(completions), components={"accuracy": [1.0] * len(completions)})

    agent = agent_for()
    agent.close()
    rewards = score_trajectories(Task(), "t", out, QUESTIONS, agent)
    assert seen["completions"] == ["<answer>408</answer>", "<answer>12</answer>"]
    assert [t["role"] for t in seen["trajectories"][0]] == ["assistant", "tool", "assistant"]
    assert rewards.total == [1.0, 1.0]


def _result(name, content):
    from gpo.tools import ToolResult

    return ToolResult(name, content, False, 0.0)


def _with_template(tokenizer, template):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def test_evaluation_grades_each_trajectorys_answer(tokenizer):
    from gpo import registry
    from gpo.evaluate import evaluate

    registry.load_builtins()
    task = registry.get("task", "arith").build(registry.get("task", "arith").config(digits=2, operators=("*",)))
    examples = list(task.load("test"))[:3]
    agent = agent_for()
    try:
        records, summary = evaluate(None, tokenizer, ScriptedBackend(ScriptedConfig(), tokenizer=tokenizer), task,
                                    examples, Sampling(200, greedy=True), batch_size=4, samples=2, agent=agent)
    finally:
        agent.close()
    # sample 0 of each question calls the calculator and answers its result; sample 1 answers 0 at once
    assert [r["correct"] for r in records] == [True, False] * 3
    assert summary["accuracy"] == pytest.approx(0.5) and summary["pass_at_2"] == pytest.approx(1.0)
    assert all(r["completion"].startswith("<answer>") for r in records)
