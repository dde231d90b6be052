"""Environments in TRL's convention (gpo/environments.py): the checked class, each refusal naming the key, and the
calls of an episode on one instance in this process: reset from a row, tools with the same error results as
task.tools, respond and get_reward, and a broken environment reported as one."""

from __future__ import annotations

import json

import pytest

from gpo import user_code
from gpo.environments import Environment, EnvironmentFailure, call_method, load_environment, reset, respond, reward
from gpo.errors import UserError
from gpo.tools import ToolCall
from kit import plugins_importable

plugins_importable()  # gpo_toolbox
import gpo_toolbox  # noqa: E402

GENEROUS_S = 30.0  # only stops a broken test
SHORT_S = 0.5  # for the calls meant to be stopped


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, arguments, None)


def error_of(content: str) -> str:
    return json.loads(content)["error"]


@pytest.fixture
def guess() -> tuple[Environment, gpo_toolbox.Guess]:
    env = load_environment("gpo_toolbox:Guess")
    instance = env.cls()
    assert reset(instance, {"secret": 7, "question": "q", "answer": "7"}, GENEROUS_S) == "I am thinking of a number."
    return env, instance


def test_the_checked_class():
    env = load_environment("gpo_toolbox:Guess")
    assert (env.spec, env.cls, env.name) == ("gpo_toolbox:Guess", gpo_toolbox.Guess, "Guess")
    # Public methods but reset, respond, get_reward and close; the property `state` is no method.
    assert env.tools == ("explode", "guess", "hint", "numbers", "stall")
    assert env.responds and env.rewards
    by_name = {s["function"]["name"]: s["function"] for s in env.schemas}
    assert list(by_name) == list(env.tools)
    assert by_name["guess"] == {"name": "guess", "description": "Checks a guess against the hidden number.",
                                "parameters": {"type": "object",
                                               "properties": {"number": {"type": "integer",
                                                                         "description": "The guess."}},
                                               "required": ["number"]},
                                "return": {"type": "string"}}  # no `self`
    quiet = load_environment("gpo_toolbox.Quiet")
    assert (quiet.tools, quiet.responds, quiet.rewards) == ((), False, False)


@pytest.mark.parametrize("spec,message", [
    ("no_such_env_module:Game", "cannot import module `no_such_env_module`"),
    ("gpo_toolbox:Missing", "module `gpo_toolbox` has no attribute `Missing`"),
    ("gpo_toolbox:echo", "`gpo_toolbox:echo` is not a class \\(its type is function\\)"),
    ("gpo_toolbox:NoReset", "`gpo_toolbox:NoReset` has no method `reset`"),
    ("gpo_toolbox:NeedsArguments", "cannot be made without arguments \\(it takes \\(size\\)\\): one instance "
                                   "is made per trajectory as NeedsArguments\\(\\)"),
    ("gpo_toolbox:UndocumentedTool", "cannot describe `gpo_toolbox:UndocumentedTool.move` to the model"),
    ("gpo_toolbox:BadRespond", "`respond` takes \\(\\); it must be `respond\\(self, message: str\\) -> str \\| "
                               "None`"),
])
def test_each_refusal_names_the_key(spec, message):
    with pytest.raises(UserError, match="^task\\.environment: .*" + message):
        load_environment(spec)
    with pytest.raises(UserError, match="^my.key: "):
        load_environment(spec, key="my.key")


def test_an_episode_in_this_process(guess):
    env, instance = guess
    assert instance.secret == 7  # reset was given the column it names, not the others
    results = [call_method(instance, call("guess", number=n), env, GENEROUS_S) for n in (3, 9, 7)]
    assert [(r.name, r.content, r.failed) for r in results] == [
        ("guess", "higher", False), ("guess", "lower", False), ("guess", "right", False)]
    assert call_method(instance, call("hint"), env, GENEROUS_S).content == '{"guesses": 3}'  # the state it holds
    assert reward(instance, GENEROUS_S) == 1.0
    assert respond(instance, "7", GENEROUS_S) is None  # solved: the episode ends


def test_respond_gives_the_next_user_turn_or_none():
    env = load_environment("gpo_toolbox:Guess")
    instance = env.cls()
    reset(instance, {"secret": 2}, GENEROUS_S)
    assert respond(instance, "1", GENEROUS_S) == "Not yet: you said '1'."
    assert reward(instance, GENEROUS_S) == 0.0
    quiet = load_environment("gpo_toolbox:Quiet").cls()
    assert reset(quiet, {"a": 1, "b": 2}, GENEROUS_S) is None
    assert quiet.row == {"a": 1, "b": 2}  # **kwargs takes every column
    assert respond(quiet, "hello", GENEROUS_S) is None  # no respond: the episode ends


@pytest.mark.parametrize("bad,name,error", [
    (call("explode", why="bad move"), "explode", "tool `explode` raised RuntimeError: bad move"),
    (call("numbers"), "numbers", "tool `numbers` returned a set, not text"),
    (call("guess"), "guess", "tool `guess` is missing the argument `number`"),
    (call("guess", number="7"), "guess", "argument `number` must be integer, not string"),
    (call("guess", number=7, twice=True), "guess", "tool `guess` has no argument `twice`"),
    (call("reset", secret=1), "", "unknown tool `reset`"),  # reset is no tool
    (call("get_reward"), "", "unknown tool `get_reward`"),
    (ToolCall(None, None, "the call is not valid JSON"), "", "malformed tool call"),
])
def test_a_tool_method_that_goes_wrong_is_an_error_result(guess, bad, name, error):
    env, instance = guess
    result = call_method(instance, bad, env, GENEROUS_S)
    assert result.failed and result.name == name and error in error_of(result.content)
    assert instance.secret == 7 and instance.guesses == 0  # no guess was counted


@pytest.mark.skipif(not user_code.CPU_CLOCKS, reason="no thread CPU clock here: the bound is wall time")
def test_a_hung_tool_method_is_abandoned(guess, monkeypatch):
    env, instance = guess
    monkeypatch.setattr(user_code, "WALL_FACTOR", 600)  # only the CPU bound can stop it
    gpo_toolbox.RELEASE.clear()
    try:
        result = call_method(instance, call("stall"), env, SHORT_S)
    finally:
        gpo_toolbox.RELEASE.set()  # the abandoned call stops spinning
    assert result.failed and result.name == "stall"
    assert error_of(result.content).startswith("tool `stall` did not return within 0.5 s (computing: ")
    assert error_of(result.content).endswith("and was abandoned")
    assert call_method(instance, call("guess", number=7), env, GENEROUS_S).content == "right"


@pytest.mark.parametrize("row,message", [
    ({"how": "raise"}, "Broken.reset raised KeyError: 'no board'"),
    ({"how": "number"}, "Broken.reset returned 5, not text or None"),
    ({"question": "q"}, "Broken.reset needs `how`, which the row does not have \\(its columns: question\\)"),
])
def test_a_failing_reset_is_a_broken_environment(row, message):
    instance = load_environment("gpo_toolbox:Broken").cls()
    with pytest.raises(EnvironmentFailure, match=message):
        reset(instance, row, GENEROUS_S)


@pytest.mark.parametrize("how,message", [("nan", "returned nan, not a finite number"),
                                         ("bool", "returned True, not a finite number")])
def test_a_reward_that_is_not_a_finite_number_is_a_broken_environment(how, message):
    instance = load_environment("gpo_toolbox:Broken").cls()
    reset(instance, {"how": how}, GENEROUS_S)
    with pytest.raises(EnvironmentFailure, match=f"Broken.get_reward {message}"):
        reward(instance, GENEROUS_S)
    with pytest.raises(EnvironmentFailure, match="Broken.respond returned 3, not text or None"):
        respond(instance, "hi", GENEROUS_S)
