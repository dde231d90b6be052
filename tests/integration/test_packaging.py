"""The built wheel works on its own: installed into a fresh virtual environment, `gpo` runs from that copy.

The top-level component folders (algorithms/, selection/, pruners/, allocators/, tasks/) and configs/ install as
sub-packages of `gpo` (setuptools package-dir), so this checks what a user of the wheel gets: every component
imported from the installed copy, never from the repository, the YAML configs found there, and nothing generic
such as `tasks` landing at the top of site-packages. Dependencies come from the test environment through
a .pth path line (a plain path: the editable install's import hook there stays inactive), so nothing downloads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

from kit import REPO

COMPONENT_PACKAGES = ("algorithms", "selectors", "pruners", "allocators", "tasks", "configs")  # gpo.<name>
SKIP_DIRS = {".git", ".venv", "build", "dist", "runs", "mlruns", "__pycache__", ".pytest_cache", ".hypothesis"}


def _run(cmd: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str, Path]:
    """Build from a copy of the source tree, so the build leaves no build/ or egg-info in the repository.

    Verbose, so the log holds what setuptools printed (pip hides a build backend's output otherwise)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    shutil.copytree(REPO, src, ignore=lambda d, names: [n for n in names if n in SKIP_DIRS or n.endswith(".egg-info")])
    out = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--verbose",
                "--wheel-dir", root / "dist", src], cwd=root)
    (wheel_path,) = (root / "dist").glob("gpo-*.whl")
    return wheel_path, out.stdout + out.stderr, src


@pytest.fixture(scope="module")
def wheel(built) -> Path:
    return built[0]


def test_build_declares_every_package_it_ships(built):
    """Every folder setuptools sees as a package is declared (configs/<group>/ included), so installs stay quiet:
    an undeclared one prints a "Package would be ignored" wall of text on every `pip install`."""
    _, log, _ = built
    assert "running build_py" in log  # the log does hold setuptools' own output
    assert "copying configs/algo/grpo.yaml" in log
    assert "would be ignored" not in log
    assert "absent from the `packages` configuration" not in log


def _fresh_venv(env_dir: Path) -> Path:
    """A venv without pip whose path also holds this environment's site-packages (dependencies, setuptools)."""
    _run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=env_dir.parent)
    python = env_dir / "bin" / "python"
    fresh_site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           cwd=env_dir).stdout.strip())
    (fresh_site / "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (--no-deps) and this environment's site-packages on its path."""
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    python = _fresh_venv(env_dir)
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--quiet", wheel], cwd=env_dir)
    return env_dir


def test_an_editable_install_is_quiet_and_finds_the_configs(built, tmp_path):
    """`pip install -e .` (what `make run` does) prints no setuptools package warning, and its `gpo` reads the
    YAMLs from the source tree."""
    _, _, src = built
    python = _fresh_venv(tmp_path / "env")
    out = _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-build-isolation",
                "--verbose", "-e", src], cwd=tmp_path)
    log = out.stdout + out.stderr
    assert "Successfully installed gpo" in log
    assert "would be ignored" not in log and "absent from the `packages` configuration" not in log
    listed = _run([tmp_path / "env" / "bin" / "gpo", "list", "task"], cwd=tmp_path, env=_clean_env()).stdout
    assert any(line.startswith("  arith ") for line in listed.splitlines())  # configs/task/arith.yaml
    root = _run([python, "-c", "import gpo.config; print(gpo.config.CONFIG_ROOT)"], cwd=tmp_path,
                env=_clean_env()).stdout.strip()
    assert Path(root).resolve() == (src / "configs").resolve()


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_wheel_holds_the_components_under_gpo_and_every_config(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"gpo"}  # no top-level `tasks` in site-packages
    for package in COMPONENT_PACKAGES:
        assert f"gpo/{package}/__init__.py" in names
    shipped = {n.removeprefix("gpo/configs/") for n in names if n.startswith("gpo/configs/") and n.endswith(".yaml")}
    in_repo = {str(p.relative_to(REPO / "configs")) for p in (REPO / "configs").rglob("*.yaml")}
    assert shipped == in_repo
    for component in (REPO / "pruners").glob("*.py"):
        assert f"gpo/pruners/{component.name}" in names


def test_installed_copy_runs_and_imports_nothing_from_the_repository(venv, tmp_path):
    python = venv / "bin" / "python"
    code = (
        "import json, importlib\n"
        "import gpo.config, gpo.registry\n"
        "gpo.registry.load_builtins()\n"
        f"mods = {['gpo'] + ['gpo.' + p for p in COMPONENT_PACKAGES]!r}\n"
        "paths = {m: importlib.import_module(m).__file__ for m in mods}\n"
        "paths['CONFIG_ROOT'] = str(gpo.config.CONFIG_ROOT)\n"
        "paths.update({f'{e.kind}={e.name}': importlib.import_module(e.cls.__module__).__file__\n"
        "              for k in gpo.registry.KINDS for e in gpo.registry.entries(k)})\n"
        "print(json.dumps(paths))\n"
    )
    out = _run([python, "-c", code], cwd=tmp_path, env=_clean_env())
    paths = yaml.safe_load(out.stdout)
    assert len(paths) > len(COMPONENT_PACKAGES) + 2  # components were registered from the installed copy
    for name, path in paths.items():
        assert Path(path).resolve().is_relative_to(venv.resolve()), f"{name} came from {path}"


def test_installed_gpo_command_lists_and_composes_from_its_own_configs(venv, tmp_path):
    gpo = venv / "bin" / "gpo"
    listed = _run([gpo, "list"], cwd=tmp_path, env=_clean_env()).stdout.splitlines()
    for kind in ("algo", "selector", "pruner", "allocator", "task", "backend", "tracker"):
        assert f"{kind}:" in listed
    assert any(line.startswith("  topk ") for line in listed)
    dry = _run([gpo, "run", "--dry-run", "experiment=smoke"], cwd=tmp_path, env=_clean_env()).stdout
    assert yaml.safe_load(dry)["train"]["steps"] == 2  # configs/experiment/smoke.yaml, read from the wheel
