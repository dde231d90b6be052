"""Run mypy over gpo as it installs, and over the benchmark scripts: `python tools/typecheck.py [mypy args]` (what
`make test` runs, with no arguments; arguments name other targets instead).

The component folders install under `gpo.` through setuptools' package-dir mapping (algorithms/ is gpo.algorithms,
selection/ is gpo.selectors, ...), which mypy cannot follow. This links that layout under .mypy_cache/tree (mypy_path
in pyproject.toml), brought up to date on every run so new files are seen, runs mypy, and rewrites the paths it
reports back to the files in the repository.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from the dev extra
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".mypy_cache" / "tree"


def package_dirs() -> dict[str, str]:
    """gpo's package-dir mapping from pyproject.toml, as {"gpo/tasks": "tasks", ...} (slash paths)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {package.replace(".", "/"): folder for package, folder in mapping.items()}


def link_tree(dirs: dict[str, str]) -> None:
    """TREE/gpo holds a link to each entry of gpo/ and one per mapped component folder. Only what changed is
    touched, so two checks running at once (or a check beside an editor's mypy) do not pull links from each other."""
    package = TREE / "gpo"
    package.mkdir(parents=True, exist_ok=True)
    wanted = {entry.name: entry for entry in (ROOT / "gpo").iterdir() if entry.name != "__pycache__"}
    wanted |= {installed.removeprefix("gpo/"): ROOT / folder
               for installed, folder in dirs.items() if installed != "gpo"}
    for entry in package.iterdir():
        if entry.name not in wanted or not entry.is_symlink() or Path(os.readlink(entry)) != wanted[entry.name]:
            entry.unlink(missing_ok=True)
    for name, target in wanted.items():
        try:
            (package / name).symlink_to(target)
        except FileExistsError:  # already linked (by this tree's last run, or a check running beside this one)
            pass


def real_path(line: str, dirs: dict[str, str]) -> str:
    """A mypy report line with its leading tree path (.mypy_cache/tree/gpo/tasks/math.py, or gpo/tasks/math.py)
    turned into the repository's (tasks/math.py)."""
    line = line.removeprefix(str(TREE.relative_to(ROOT)) + "/")
    for installed, folder in sorted(dirs.items(), key=lambda item: -len(item[0])):
        if line.startswith(installed + "/"):
            return folder + line[len(installed) :]
    return line


def default_targets() -> list[str]:
    """gpo, and each script of bench/ as a module: they import their sibling as `harness`, so bench/ is on mypy_path
    (pyproject.toml) and they are named as modules, not files."""
    return ["-p", "gpo", *[arg for script in sorted((ROOT / "bench").glob("*.py")) for arg in ("-m", script.stem)]]


def main(argv: list[str]) -> int:
    from mypy import api

    dirs = package_dirs()
    link_tree(dirs)
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), *(argv or default_targets())])
    sys.stdout.write("".join(real_path(line, dirs) for line in out.splitlines(keepends=True)))
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
