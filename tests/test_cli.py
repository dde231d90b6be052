"""The `gpo` command: exit codes, messages, help, listing, plug-ins, dry runs.

Each subprocess start costs a few seconds (torch is imported), so the real-process tests are the ones where the
process boundary matters (exit code, streams, entry points, no traceback); the rest call `main()` in-process.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from gpo import cli, registry
from gpo.run_config import OptimConfig
from kit import fresh_registry, make_plugin, run_gpo_all  # noqa: F401  (fresh_registry is a fixture)


def _one_paragraph_error(stderr: str) -> str:
    """The user-error contract: one line starting `gpo: error:`, no traceback."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpo: error: "), stderr
    return lines[0]


# --- real processes, started together --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    # A real installed-distribution record (dist-info with entry_points.txt) on the subprocess's PYTHONPATH,
    # and a plain module named by the `plugins` key.
    entry_point = make_plugin(tmp_path_factory.mktemp("ep"), "gpo_test_cli_plugin", "every_other")
    module = make_plugin(tmp_path_factory.mktemp("mod"), "gpo_test_cli_mod", "every_third", entry_point=False)
    return run_gpo_all({
        "dry_run": (["run", "--dry-run", "algo=grpo", "pruner=none", "allocator=static", "train.steps=3"], []),
        "unknown_pick": (["run", "algo=nope"], []),
        "unknown_key": (["run", "optim.lrr=1"], []),
        "list": (["list"], []),
        "entry_point": (["list", "pruner"], [entry_point]),
        "plugins_key": (["run", "--dry-run", "pruner=every_third", "plugins=[gpo_test_cli_mod]", "pruner.offset=2"],
                        [module]),
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


# --- in-process ----------------------------------------------------------------------------------------------------


def test_help_shows_examples(capsys):
    for argv in (["--help"], ["run", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert "examples:" in text and "gpo run algo=dapo pruner=topk allocator=dynamic task=math" in text


def test_run_help_explains_the_layer_order(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "configs/base.yaml < group picks < experiment=NAME < --config FILE < key=value overrides" in (
        capsys.readouterr().out
    )


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "usage: gpo" in capsys.readouterr().out


def test_config_prints_the_same_yaml_as_a_dry_run(capsys):
    assert cli.main(["config", "algo=dapo", "train.steps=4"]) == 0
    printed = capsys.readouterr().out
    assert cli.main(["run", "--dry-run", "algo=dapo", "train.steps=4"]) == 0
    assert capsys.readouterr().out == printed
    assert yaml.safe_load(printed)["algo"]["name"] == "dapo"


def test_a_missing_config_file_exits_2(tmp_path, capsys):
    missing = tmp_path / "absent.yaml"
    assert cli.main(["run", "--dry-run", "--config", str(missing)]) == 2
    assert capsys.readouterr().err == f"gpo: error: --config file `{missing}` does not exist.\n"


def test_list_of_an_unknown_kind_exits_2(capsys):
    assert cli.main(["list", "prunr"]) == 2
    assert "unknown kind `prunr`; kinds are algo, selector, pruner" in capsys.readouterr().err


def test_list_takes_a_plugins_override_without_a_kind(tmp_path, monkeypatch, capsys, fresh_registry):  # noqa: F811
    monkeypatch.syspath_prepend(str(make_plugin(tmp_path, "gpo_test_list_mod", "every_fourth", entry_point=False)))
    assert cli.main(["list", "plugins=[gpo_test_list_mod]"]) == 0
    assert "  every_fourth Keep every second completion (a test plug-in)." in capsys.readouterr().out


def test_an_internal_error_exits_1_with_a_traceback(monkeypatch, capsys):
    def broken(*_):
        raise RuntimeError("a bug")

    monkeypatch.setattr("gpo.config.compose", broken)
    assert cli.main(["config"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: a bug" in err
    assert err.rstrip().endswith("gpo: internal error (a bug in gpo, please report it with the traceback above)")
