"""Tools in TRL's convention (gpo/tools.py): schemas from typed, documented functions, each refusal naming the key,
parsing <tool_call> blocks, and running calls in worker processes: results as text, error results for everything
that goes wrong, and a hung or crashed tool stopped or replaced so that the next call works.

Calls meant to succeed get a generous bound (30 s); only the calls meant to be stopped get 0.5 s."""

from __future__ import annotations

import json
import os
import signal

import pytest

from gpo import user_code
from gpo.errors import UserError
from gpo.tools import Tool, ToolCall, ToolRunner, load_tools, parse_tool_calls, tools_system_prompt
from kit import plugins_importable, until

plugins_importable()  # gpo_toolbox, imported by spec here and in the workers

GENEROUS_S = 30.0  # only stops a broken test
SHORT_S = 0.5  # for the calls meant to be stopped
WORKING = ["gpo_toolbox:echo", "gpo_toolbox:add", "gpo_toolbox:pick", "gpo_toolbox:shout", "gpo_toolbox:fail",
           "gpo_toolbox:leave", "gpo_toolbox:give_set", "gpo_toolbox:give_none", "gpo_toolbox:die",
           "gpo_toolbox:kill_self", "calculator"]


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, arguments, None)


def error_of(content: str) -> str:
    return json.loads(content)["error"]


@pytest.fixture(scope="module")
def runner():
    with ToolRunner(load_tools(WORKING), timeout_s=GENEROUS_S, workers=2) as r:
        yield r


# --- loading ----------------------------------------------------------------------------------------------------


def test_the_schema_of_a_typed_documented_function():
    (tool,) = load_tools(["gpo_toolbox:echo"])
    assert tool == Tool("echo", "gpo_toolbox:echo", {
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Repeats a text.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "description": "The text to repeat."},
                               "times": {"type": "integer", "description": "How many times to repeat it."}},
                "required": ["text"],  # `times` has a default
            },
            "return": {"type": "string"},
        },
    })
    assert load_tools(["gpo_toolbox.echo"])[0].name == "echo"  # module.function works too


@pytest.mark.parametrize("specs,message", [
    (["no_such_tool_module:f"], "cannot import module `no_such_tool_module`"),
    (["gpo_toolbox:missing"], "module `gpo_toolbox` has no attribute `missing`"),
    (["echo"], "`echo` is not `module:name`"),
    (["gpo_toolbox:NOT_A_FUNCTION"], "is an int, not a plain function"),
    (["gpo_toolbox:Guess"], "is a type, not a plain function"),
    (["math:sqrt"], "is a builtin_function_or_method, not a plain function"),
    (["gpo_toolbox:undocumented"], "cannot describe `gpo_toolbox:undocumented` to the model: .*no docstring.*"
                                   "Google-style docstring"),
    (["gpo_toolbox:unhinted"], "cannot describe `gpo_toolbox:unhinted`.*type hint.*Give every parameter a type "
                               "hint"),
    (["gpo_toolbox:no_args_section"], "cannot describe .*no description for the argument 'x'.*`Args:`"),
    (["gpo_toolbox:star"], "`gpo_toolbox:star` takes `values`, which a tool call cannot pass"),
    (["gpo_toolbox:echo", "gpo_toolbox:echo_again"], "`gpo_toolbox:echo` and `gpo_toolbox:echo_again` are both "
                                                     "named `echo`"),
])
def test_each_refusal_names_the_key(specs, message):
    with pytest.raises(UserError, match="^task\\.tools: .*" + message):
        load_tools(specs)
    with pytest.raises(UserError, match="^my.key: "):
        load_tools(specs, key="my.key")


# --- parsing ----------------------------------------------------------------------------------------------------


def test_parse_one_call():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2 * 3"}, None)]


def test_parse_two_calls_in_order():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}, None), ToolCall("b", {}, None)]


def test_parse_arguments_given_as_a_json_string():
    text = '<tool_call>{"name": "a", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("a", {"x": [1, 2]}, None)]


def test_parse_no_call():
    assert parse_tool_calls("The answer is 6.") == []
    assert parse_tool_calls("a stray </tool_call> closes nothing") == []


@pytest.mark.parametrize("body,error", [
    ('{"name": "a", "arguments": {', "not valid JSON"),
    ("calculator(2 * 3)", "not valid JSON"),
    ('["a", {}]', "not a JSON object"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": 3, "arguments": {}}', 'no "name"'),
    ('{"name": "a", "arguments": [1]}', '"arguments" is not a JSON object'),
    ('{"name": "a", "arguments": "[1]"}', '"arguments" is not a JSON object'),
    ('{"name": "a", "arguments": "{oops"}', '"arguments" is a string that is not JSON'),
    ("[" * 100000 + "]" * 100000, "not valid JSON"),  # nested past the recursion limit
])
def test_parse_malformed_calls(body, error):
    (parsed,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert parsed.arguments is None and parsed.error is not None and error in parsed.error


def test_an_unclosed_tag_is_one_malformed_call_after_the_good_ones():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "argu'
    good, unclosed = parse_tool_calls(text)
    assert good == ToolCall("a", {}, None)
    assert unclosed.name is None and unclosed.arguments is None and "never closed" in (unclosed.error or "")


def test_the_system_prompt_lists_the_tools_and_teaches_the_layout_the_parser_reads():
    schemas = [t.schema for t in load_tools(["gpo_toolbox:echo", "calculator"])]
    prompt = tools_system_prompt(schemas)
    for schema in schemas:
        assert json.dumps(schema) in prompt
    assert "<tool_response>" in prompt and "`tool` turn" in prompt
    assert parse_tool_calls(prompt) == [ToolCall("tool_name", {"argument_name": "value"}, None)]


# --- running ----------------------------------------------------------------------------------------------------


def test_results_come_back_as_text_in_order(runner):
    results = runner.run([call("echo", text="ab", times=2), call("calculator", expression="1234 * 5678"),
                          call("add", a=2, b=0.5), call("pick", options=[3, 9, 4]), call("shout", text="hey")])
    assert [(r.name, r.content, r.failed) for r in results] == [
        ("echo", "abab", False), ("calculator", "7006652", False), ("add", "2.5", False),
        ("pick", '{"picked": 9, "mode": null}', False), ("shout", "HEY", False)]
    assert all(r.seconds >= 0 for r in results)


@pytest.mark.parametrize("bad,name,error", [
    (call("fail", message="no luck"), "fail", "tool `fail` raised ValueError: no luck"),
    (call("leave"), "leave", "tool `leave` raised SystemExit: 4"),
    (call("give_set"), "give_set", "tool `give_set` returned a set, not text"),
    (call("give_none"), "give_none", "tool `give_none` returned None, not text"),
    (call("nope", x=1), "", "unknown tool `nope`; the tools are `add`, `calculator`, "),
    (call("echo"), "echo", "tool `echo` is missing the argument `text`"),
    (call("echo", text="a", loud=True), "echo", "tool `echo` has no argument `loud`; it takes `text`, `times`"),
    (call("echo", text=3), "echo", "tool `echo`: argument `text` must be string, not integer"),
    (call("echo", text="a", times=1.5), "echo", "argument `times` must be integer, not number"),
    (call("add", a=True, b=1), "add", "argument `a` must be integer, not boolean"),
    (call("pick", options=[1, "2"]), "pick", "argument `options` must be array of integer, not array of integer "
                                             "and string"),
    (call("calculator", expression="__import__('os')"), "calculator", "raised ValueError: `__import__('os')` is "
                                                                      "not arithmetic"),
    (ToolCall(None, None, "the call is not valid JSON"), "", "malformed tool call: the call is not valid JSON"),
])
def test_everything_that_goes_wrong_is_an_error_result(runner, bad, name, error):
    before = runner.worker_pids()
    (result,) = runner.run([bad])
    assert result.failed and result.name == name and error in error_of(result.content)
    assert runner.worker_pids() == before  # none of these costs a worker


def test_a_worker_that_exits_is_replaced(runner):
    results = runner.run([call("die", code=3), call("echo", text="still here")])
    assert results[0].failed and error_of(results[0].content) == "tool `die` crashed: its process exited with code 3"
    assert (results[1].content, results[1].failed) == ("still here", False)
    (killed,) = runner.run([call("kill_self")])
    assert killed.failed and "was killed by SIGKILL" in error_of(killed.content)
    assert runner.run([call("echo", text="and again")])[0].content == "and again"


def ended(pid: int) -> bool:
    """Whether process `pid` (a child of this one) has ended: a zombie, or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc")
def test_a_worker_killed_while_idle_is_replaced_before_the_next_call(runner):
    runner.run([call("echo", text="up")])
    pids = runner.worker_pids()
    for pid in pids:
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    until(lambda: all(ended(pid) for pid in pids if pid is not None), "the killed workers to end")
    results = runner.run([call("echo", text=str(i)) for i in range(4)])
    assert [(r.content, r.failed) for r in results] == [("0", False), ("1", False), ("2", False), ("3", False)]


@pytest.mark.parametrize("tool,reason", [("spin", "computing: "), ("nap", "waiting: ")])
def test_a_hung_tool_is_stopped_and_the_next_call_works(monkeypatch, tool, reason):
    # Only the bound under test can stop it: the wall backstop is moved out of reach (300 s).
    monkeypatch.setattr(user_code, "WALL_FACTOR", 600)
    with ToolRunner(load_tools([f"gpo_toolbox:{tool}", "gpo_toolbox:echo"]), timeout_s=SHORT_S) as runner:
        (stopped,) = runner.run([call(tool)])
        assert stopped.failed and stopped.name == tool
        assert error_of(stopped.content).startswith(f"tool `{tool}` did not return within 0.5 s ({reason}")
        assert error_of(stopped.content).endswith("and was stopped")
        runner.timeout_s = GENEROUS_S  # the next call is meant to succeed
        assert runner.run([call("echo", text="next")])[0].content == "next"


def test_tools_that_cannot_load_in_a_worker_give_error_results():
    schema = load_tools(["gpo_toolbox:echo"])[0].schema
    with ToolRunner([Tool("echo", "no_such_tool_module:echo", schema)], timeout_s=GENEROUS_S) as runner:
        results = runner.run([call("echo", text="a"), call("echo", text="b")])
        assert all(r.failed and "could not be loaded in a worker process" in error_of(r.content) for r in results)


def test_close_is_safe_unused_and_twice():
    runner = ToolRunner(load_tools(["gpo_toolbox:echo"]), timeout_s=GENEROUS_S)
    runner.close()
    assert runner.run([]) == [] and runner.worker_pids() == []  # no call, no worker
    assert runner.run([call("echo", text="a")])[0].content == "a"
    runner.close()
    runner.close()
    assert runner.worker_pids() == []
