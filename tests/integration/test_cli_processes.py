"""The `gpo` command as a real process: exit codes, one-line errors on stderr, `gpo list` with an installed
entry point, a `plugins` module in a dry run. The processes start together (each spends seconds importing torch);
the in-process checks of the same command are in tests/unit/test_cli.py.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from gpo import registry
from gpo.run_config import OptimConfig
from kit import make_plugin, run_gpo_all


def _one_paragraph_error(stderr: str) -> str:
    """The user-error contract: one line starting `gpo: error:`, no traceback."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpo: error: "), stderr
    return lines[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    # A real installed-distribution record (dist-info with entry_points.txt) on the subprocess's PYTHONPATH,
    # and a plain module named by the `plugins` key.
    entry_point = make_plugin(tmp_path_factory.mktemp("ep"), "gpo_test_cli_plugin", "every_other")
    module = make_plugin(tmp_path_factory.mktemp("mod"), "gpo_test_cli_mod", "every_third", entry_point=False)
    taken = tmp_path_factory.mktemp("taken") / "taken"  # an output_dir that is a file
    taken.write_text("")
    return run_gpo_all({
        "dry_run": (["run", "--dry-run", "algo=grpo", "pruner=none", "allocator=static", "train.steps=3"], []),
        "unknown_pick": (["run", "algo=nope"], []),
        "unknown_key": (["run", "optim.lrr=1"], []),
        "list": (["list"], []),
        "entry_point": (["list", "pruner"], [entry_point]),
        "plugins_key": (["run", "--dry-run", "pruner=every_third", "plugins=[gpo_test_cli_mod]", "pruner.offset=2"],
                        [module]),
        "output_dir_taken": (["run", "tracker=none", "backend=hf", f"output_dir={taken}"], []),
    })


def test_dry_run_prints_the_resolved_config_and_exits_0(runs):
    out = runs["dry_run"]
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert (cfg["algo"]["name"], cfg["pruner"], cfg["allocator"]["name"]) == ("grpo", {"name": "none"}, "static")
    assert cfg["train"]["steps"] == 3
    assert cfg["optim"]["lr"] == OptimConfig().lr  # the dataclass default, resolved into the printout


def test_an_unknown_pick_exits_2_naming_the_valid_choices(runs):
    out = runs["unknown_pick"]
    assert out.returncode == 2
    registry.load_builtins()
    valid = ", ".join(registry.names("algo"))
    assert _one_paragraph_error(out.stderr) == f"gpo: error: unknown algo `nope`. Valid choices: {valid}."


def test_an_unknown_key_exits_2_suggesting_the_closest(runs):
    out = runs["unknown_key"]
    assert out.returncode == 2
    assert "unknown key `optim.lrr`. Did you mean `optim.lr`?" in _one_paragraph_error(out.stderr)
    assert out.stdout == ""


def test_list_prints_every_kind_and_every_entry(runs):
    out = runs["list"]
    assert out.returncode == 0, out.stderr
    registry.load_builtins()
    lines = out.stdout.splitlines()
    for kind in registry.KINDS:
        assert f"{kind}:" in lines
        assert registry.names(kind), f"no built-in {kind} registered"
        # Built-ins only: test plug-ins that earlier tests registered in this process are not `gpo list`'s to show.
        for entry in (e for e in registry.entries(kind) if e.cls.__module__.startswith("gpo.")):
            assert any(line.startswith(f"  {entry.name} ") and entry.summary in line for line in lines), entry.name


def test_a_plugin_entry_point_shows_up_in_gpo_list(runs):
    out = runs["entry_point"]
    assert out.returncode == 0, out.stderr
    assert "  every_other  Keep every second completion (a test plug-in)." in out.stdout.splitlines()
    assert "      offset = 0" in out.stdout.splitlines()


def test_a_plugins_key_brings_a_component_into_a_dry_run(runs):
    out = runs["plugins_key"]
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["pruner"] == {"name": "every_third", "offset": 2}
    assert cfg["plugins"] == ["gpo_test_cli_mod"]


def test_the_refusal_is_a_real_exit_code_2_without_traceback(runs):
    # What used to end in an internal-error traceback when the engine created the run folder.
    proc = runs["output_dir_taken"]
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("gpo: error: output_dir=") and "Traceback" not in proc.stderr
