"""Run mypy over gpo as it installs: `python tools/typecheck.py [mypy args]` (what `make test` runs).

The component folders install under `gpo.` through setuptools' package-dir mapping (algorithms/ is gpo.algorithms,
selection/ is gpo.selectors, ...), which mypy cannot follow. This links that layout under .mypy_cache/tree (mypy_path
in pyproject.toml), rebuilt on every run so new files are seen, runs mypy, and rewrites the paths it reports back to
the files in the repository.
"""

from __future__ import annotations

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
    """TREE/gpo holds a link to each entry of gpo/ and one per mapped component folder."""
    package = TREE / "gpo"
    if package.exists():
        for entry in package.iterdir():
            entry.unlink()
    package.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "gpo").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for installed, folder in dirs.items():
        if installed != "gpo":
            (TREE / installed).symlink_to(ROOT / folder, target_is_directory=True)


def real_path(line: str, dirs: dict[str, str]) -> str:
    """A mypy report line with its leading tree path (.mypy_cache/tree/gpo/tasks/math.py, or gpo/tasks/math.py)
    turned into the repository's (tasks/math.py)."""
    line = line.removeprefix(str(TREE.relative_to(ROOT)) + "/")
    for installed, folder in sorted(dirs.items(), key=lambda item: -len(item[0])):
        if line.startswith(installed + "/"):
            return folder + line[len(installed) :]
    return line


def main(argv: list[str]) -> int:
    from mypy import api

    dirs = package_dirs()
    link_tree(dirs)
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), *argv])
    sys.stdout.write("".join(real_path(line, dirs) for line in out.splitlines(keepends=True)))
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
