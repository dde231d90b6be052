"""The `gpo` command: exit codes, messages, help, listing, plug-ins, dry runs.

Here `main()` runs in-process; the real-process tests, where the process boundary matters (exit code, streams,
entry points, no traceback), are in tests/integration/test_cli_processes.py.
"""

from __future__ import annotations

import re

import pytest
import yaml

from gpo import cli
from kit import fresh_registry, make_plugin  # noqa: F401  (fresh_registry is a fixture)

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


def test_help_lists_every_kind_and_every_config_group(capsys):
    """The kinds come from the registry's list and the groups from the shipped config folders, so a new kind
    or group cannot be left out of the help."""
    from gpo.config import CONFIG_ROOT
    from gpo.run_config import KINDS

    groups = sorted(p.name for p in CONFIG_ROOT.iterdir() if p.is_dir() and not p.name.startswith("_"))
    assert {"selector", "correction"} <= set(KINDS) <= set(groups)
    for argv, expected in ((["--help"], KINDS), (["run", "--help"], groups), (["list", "--help"], KINDS)):
        with pytest.raises(SystemExit):
            cli.main(argv)
        text = " ".join(capsys.readouterr().out.split())  # argparse re-wraps help lines
        missing = [name for name in expected if not re.search(rf"\b{name}\b", text)]
        assert not missing, (argv, missing)


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "usage: gpo" in capsys.readouterr().out


def test_config_prints_the_same_yaml_as_a_dry_run(capsys):
    assert cli.main(["config", "algo=dapo", "train.steps=4"]) == 0
    printed = capsys.readouterr().out
    assert cli.main(["run", "--dry-run", "algo=dapo", "train.steps=4"]) == 0
    assert capsys.readouterr().out == printed
    assert yaml.safe_load(printed)["algo"]["name"] == "dapo"


def test_overrides_after_a_flag_count_in_the_order_typed(capsys):
    assert cli.main(["run", "train.steps=4", "--dry-run", "algo=dapo", "train.steps=5"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["algo"]["name"] == "dapo" and printed["train"]["steps"] == 5
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--dry-run", "train.steps=4", "--no-such-flag"])
    assert exit_.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


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
