"""Every repository path that code or docs cite exists: a renamed or moved file leaves no stale pointer behind.

A citation is a path that starts with one of the repository's top-level folders (`gpo/engine.py`,
`docs/async.md`, `tests/unit/test_layers.py`, ...). Paths as installed (`gpo/tasks/math.py`) are read through
pyproject's package-dir table (`tasks/math.py`). Not citations: placeholders in capitals (`bench/NAME.py`) and the
files a quoted command will write (`--save FILE`, `--out FILE`). Test files are not scanned: their string literals
are test data (made-up paths), not pointers.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
SCANNED = (".py", ".md", ".yaml", ".sh", ".toml", "Makefile")
WRITTEN_BY_COMMAND = re.compile(r"--(?:save|out)\s+$")


def top_folders() -> list[str]:
    return sorted(p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") or p.name == ".ci")


def installed_names() -> dict[str, str]:
    """`gpo/tasks` -> `tasks`, ... from pyproject's package-dir (the component folders install under gpo)."""
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name.replace(".", "/"): folder for name, folder in table.items() if name != "gpo"}


def resolve(path: str, installed: dict[str, str]) -> Path:
    for name, folder in sorted(installed.items(), key=lambda item: -len(item[0])):
        if path == name or path.startswith(name + "/"):
            return REPO / (folder + path[len(name):])
    return REPO / path


def citations(text: str, tops: list[str]) -> list[tuple[int, str]]:
    folders = "|".join(re.escape(t) for t in tops)
    pattern = re.compile(rf"(?<![\w./-])((?:{folders})/[\w./-]*[\w-])")
    found = []
    for match in pattern.finditer(text):
        path = match.group(1)
        placeholder = any(part.isupper() for part in re.split(r"[/.]", path))
        if placeholder or WRITTEN_BY_COMMAND.search(text[max(0, match.start() - 40):match.start()]):
            continue
        found.append((text.count("\n", 0, match.start()) + 1, path))
    return found


def scanned_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    return [REPO / f for f in listed if f.endswith(SCANNED) and not f.startswith("tests/")
            and (REPO / f).is_file()]


def test_every_cited_repository_path_exists():
    tops, installed = top_folders(), installed_names()
    missing = [f"{f.relative_to(REPO)}:{number}: {path}"
               for f in scanned_files() for number, path in citations(f.read_text(), tops)
               if not resolve(path, installed).exists()]
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_the_scan_finds_citations_and_resolves_installed_names():
    """The rule can fail: a made-up path is reported, an installed name maps to its folder, placeholders and
    a command's output file are skipped."""
    tops, installed = top_folders(), installed_names()
    text = ("see gpo/engine.py and docs/nowhere.md; bench/NAME.py; `run --save\n  docs/benchmarks/new.json`\n"
            "gpo/tasks/math.py, gpo/selectors/screen.py")
    found = citations(text, tops)
    assert [p for _, p in found] == ["gpo/engine.py", "docs/nowhere.md", "gpo/tasks/math.py",
                                     "gpo/selectors/screen.py"]
    assert [resolve(p, installed).exists() for _, p in found] == [True, False, True, True]
