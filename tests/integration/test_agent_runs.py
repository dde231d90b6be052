"""Multi-turn runs of the engine on a tiny model with a scripted backend (tests/plugins/gpo_scripted.py): the tool's
results reach the model and the reward, tool tokens never train, every objective and lever runs on trajectories,
an environment's replies make a genuinely multi-turn episode, and bad tools are refused before anything loads."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from gpo import registry
from gpo.step_math import with_loss_mask
from kit import REPO, plugins_importable, recorded, tiny_config

registry.load_builtins()
ALGOS = sorted(registry.names("algo"))
# every objective, each beside another selector / pruner / allocator, so each lever also runs on trajectories
LEVERS = [("none", "none", "static"), ("screen", "topk", "dynamic"), ("greso", "random", "static"),
          ("mopps", "threshold", "dynamic")]
CALCULATOR = ["task=arith", "task.tools=[calculator]", "backend=scripted_turns", "plugins=[gpo_scripted]",
              "train.max_completion_length=96", "task.operators=['*']", "task.digits=2"]


def engine(tiny_model_path, tmp_path, *extra, base=tuple(CALCULATOR)):
    from gpo.engine import Engine

    plugins_importable()
    return Engine(tiny_config(tiny_model_path, tmp_path, *base, *extra))


@pytest.mark.parametrize("algo", ALGOS)
def test_every_objective_and_lever_trains_on_trajectories(algo, tiny_model_path, tmp_path):
    selector, pruner, allocator = LEVERS[ALGOS.index(algo) % len(LEVERS)]
    extra = [f"algo={algo}", f"selector={selector}", f"pruner={pruner}", f"allocator={allocator}"]
    if pruner == "threshold":
        extra.append("pruner.gamma=0.05")
    if selector == "screen":
        extra.append("selector.n_screen=2")
    eng = engine(tiny_model_path, tmp_path, *extra)
    seen = recorded(eng)
    try:
        metrics = eng.step()
    finally:
        eng.parts.close()
    assert math.isfinite(metrics.get("loss/total", 0.0))
    # the scripted model calls the calculator on every other row of a group, once
    assert metrics["tool/calls_per_trajectory"] == pytest.approx(0.5)
    assert metrics["tool/calling_share"] == pytest.approx(0.5) and metrics["tool/failures"] == 0
    assert metrics["tool/calls/calculator"] == metrics["tool/trajectories"] / 2
    rows = seen[0]
    if len(rows):  # the loss mask the step fills for them leaves the tool tokens out
        assert not (with_loss_mask(eng.objective, rows).loss_mask.bool() & rows.tool_tokens).any()


def test_the_tools_result_is_the_answer_the_reward_scores(tiny_model_path, tmp_path):
    eng = engine(tiny_model_path, tmp_path)
    seen = recorded(eng)
    try:
        metrics = eng.step()
    finally:
        eng.parts.close()
    # calling rows answer with the calculator's result (right), the others answer 0 (wrong): half pass
    assert metrics["reward/success_rate"] == pytest.approx(0.5)
    rows = seen[0]
    calling = rows.tool_tokens.any(dim=1)
    assert torch.equal(rows.reward_components["accuracy"] > 0, calling)


def test_a_trajectory_ends_at_the_turn_limit(tiny_model_path, tmp_path):
    eng = engine(tiny_model_path, tmp_path, "backend.script=forever", "task.max_turns=3", "task.max_tool_calls=1",
                 "train.max_completion_length=400")
    try:
        metrics = eng.step()
    finally:
        eng.parts.close()
    assert metrics["tool/turns_per_trajectory"] == 3
    assert metrics["tool/calls_per_trajectory"] == 2 and metrics["tool/failures"] == metrics["tool/trajectories"]


def test_an_environment_answers_turns_until_the_episode_ends(tiny_model_path, tmp_path):
    eng = engine(tiny_model_path, tmp_path, "task=dataset", f"task.path={hidden_numbers(tmp_path)}",
                 "task.environment=gpo_envs:GuessNumber", "task.grader=none", "task.pass_criterion=GuessNumber",
                 "backend=scripted_turns", "backend.script=talk", "task.max_turns=8", "train.max_completion_length=200",
                 "plugins=[gpo_scripted,gpo_envs]", base=())
    seen = recorded(eng)
    try:
        metrics = eng.step()
    finally:
        eng.parts.close()
    rows = seen[0]
    # the scripted guesser says 1, 2, 3, ...: the hidden 4 is found at the fourth turn, after three replies
    assert metrics["tool/turns_per_trajectory"] == 4 and metrics["tool/calls_per_trajectory"] == 0
    assert rows.reward_components["GuessNumber"].tolist() == [1.0] * len(rows)
    assert (rows.tool_tokens.any(dim=1)).all()  # the replies are inserted tokens, never trained


def hidden_numbers(tmp_path):
    import json

    path = tmp_path / "guess.jsonl"
    path.write_text("".join(json.dumps({"question": f"Game {i}.", "answer": "4"}) + "\n" for i in range(40)))
    return path


@pytest.mark.parametrize("setting,message", [
    ("task.tools=[no_such_module:f]", "task.tools"),
    ("task.tools=[gpo_envs:Counter]", "task.tools"),
    ("task.environment=gpo_envs:NoReset", "task.environment"),
    ("task.environment=gpo_envs:Undocumented", "task.environment"),
    ("task.max_tool_calls=-1", "task.max_tool_calls"),
    ("task.tool_timeout_s=0", "task.tool_timeout_s"),
])
def test_a_bad_tool_or_environment_is_refused_at_dry_run(setting, message, tmp_path):
    out = subprocess.run([sys.executable, "-m", "gpo", "run", "task=arith", setting, f"output_dir={tmp_path}",
                          "tracker=none", "--dry-run"], capture_output=True, text=True, cwd=REPO / "tests" / "plugins",
                         timeout=600)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


def test_a_generator_running_ahead_rolls_out_trajectories(tiny_model_path, tmp_path):
    # gpo's decoder on the random tiny model: trajectories whose turns rarely call a tool, run in the generator's
    # process (whose tool workers it starts) with the generator's log-probs of the model's tokens
    eng = engine(tiny_model_path, tmp_path, "train.max_staleness=1", "backend=hf", "plugins=[]")
    try:
        metrics = [eng.step() for _ in range(2)]
    finally:
        eng.rollouts.close()
        eng.parts.close()
    for m in metrics:
        assert m["tool/trajectories"] >= 8 and m["tool/turns_per_trajectory"] >= 1
        assert math.isfinite(m.get("loss/total", 0.0))
