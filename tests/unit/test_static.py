"""Static rules checked with the tests: no source file over 600 lines; the type-check script's path mapping.

ruff and mypy themselves run in `make test` before pytest (Makefile `check`), configured in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600


def _typecheck_module():
    spec = importlib.util.spec_from_file_location("typecheck", ROOT / "tools" / "typecheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def source_folders() -> list[Path]:
    """Every folder that installs as part of gpo (pyproject's package-dir mapping), plus bench/, tools/ and tests/."""
    mapped = _typecheck_module().package_dirs().values()
    return sorted({ROOT / folder for folder in mapped} | {ROOT / "bench", ROOT / "tools", ROOT / "tests"})


def test_no_source_file_is_over_600_lines():
    files = [path for folder in source_folders() for path in folder.rglob("*.py")]
    found = {path.relative_to(ROOT).as_posix() for path in files}
    # The walk really covers the mapped folders (a wrong root would pass on no files at all).
    assert {"gpo/engine.py", "algorithms/grpo.py", "selection/__init__.py", "tasks/math.py", "bench/steps.py"} <= found
    too_long = {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            count = sum(1 for _ in f)
        if count > MAX_LINES:
            too_long[path.relative_to(ROOT).as_posix()] = count
    assert too_long == {}, f"split these files (at most {MAX_LINES} lines each): {too_long}"


def test_typecheck_reports_findings_at_the_repository_paths():
    typecheck = _typecheck_module()
    dirs = typecheck.package_dirs()
    assert dirs["gpo/selectors"] == "selection" and dirs["gpo/tasks"] == "tasks" and dirs["gpo"] == "gpo"
    line = "gpo/selectors/screen.py:12: error: x  [arg-type]\n"
    assert typecheck.real_path(line, dirs) == "selection/screen.py:12: error: x  [arg-type]\n"
    assert typecheck.real_path(".mypy_cache/tree/gpo/tasks/math.py:1: note: y", dirs) == "tasks/math.py:1: note: y"
    # gpo's own modules keep their path; a gpo module whose name merely starts like a component folder is not mapped.
    assert typecheck.real_path("gpo/engine.py:5: error: z", dirs) == "gpo/engine.py:5: error: z"
    assert typecheck.real_path("gpo/tasks_extra.py:5: error: z", dirs) == "gpo/tasks_extra.py:5: error: z"
    assert typecheck.real_path("Found 1 error in 1 file", dirs) == "Found 1 error in 1 file"


def test_typecheck_covers_gpo_and_the_benchmark_scripts():
    targets = _typecheck_module().default_targets()
    assert targets[:2] == ["-p", "gpo"]
    modules = [name for flag, name in zip(targets[2::2], targets[3::2]) if flag == "-m"]
    assert len(modules) == len(targets[2:]) // 2  # every later target is a module
    assert {"harness", "time_to_accuracy", "steps", "generation"} <= set(modules)
    assert "gpu_check" not in modules  # bench/gpu_check.sh is no Python


def test_typecheck_links_the_installed_layout(tmp_path, monkeypatch):
    typecheck = _typecheck_module()
    monkeypatch.setattr(typecheck, "TREE", tmp_path / "tree")
    dirs = typecheck.package_dirs()
    typecheck.link_tree(dirs)
    package = tmp_path / "tree" / "gpo"
    (package / "gone.py").symlink_to(tmp_path / "gone.py")  # a module deleted from gpo/ since the last run
    (package / "engine.py").unlink()
    (package / "engine.py").symlink_to(tmp_path / "elsewhere.py")  # a link that points somewhere else
    typecheck.link_tree(dirs)  # a second run keeps what is right and mends the rest
    assert not (package / "gone.py").is_symlink()
    assert (package / "engine.py").resolve() == ROOT / "gpo" / "engine.py"
    assert (package / "selectors").resolve() == ROOT / "selection"
    assert (package / "algorithms" / "grpo.py").is_file()
    assert not (package / "__pycache__").exists()
