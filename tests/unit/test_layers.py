"""The import layers of docs/architecture.md, read from the source with `ast` (every import, those inside functions
too): no module imports a higher layer, the component folders import neither each other nor anything above the
registry, and no two modules import each other through any chain."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Each top-level folder is the package it installs as (pyproject.toml's package-dir, checked below).
FOLDERS = {"gpo": "gpo", "algorithms": "gpo.algorithms", "selection": "gpo.selectors", "pruners": "gpo.pruners",
           "allocators": "gpo.allocators", "tasks": "gpo.tasks", "corrections": "gpo.corrections",
           "configs": "gpo.configs"}
COMPONENT_PACKAGES = ("gpo.algorithms", "gpo.selectors", "gpo.pruners", "gpo.allocators", "gpo.tasks",
                      "gpo.corrections")

# Lowest first. A module named here, or inside a package named here, sits in that layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("data", ("gpo", "gpo.errors", "gpo.schema", "gpo.types", "gpo.run_config", "gpo.configs")),
    ("core", ("gpo.registry", "gpo.hardware", "gpo.ops", "gpo.quota", "gpo.logprobs", "gpo.step_math",
              "gpo.rollout_phases", "gpo.user_code")),
    ("components", COMPONENT_PACKAGES),
    ("parts", ("gpo.config", "gpo.preflight", "gpo.build", "gpo.backends", "gpo.tracking", "gpo.tracking_store",
               "gpo.models", "gpo.parallel", "gpo.distributed", "gpo.decoding", "gpo.generation", "gpo.checkpoint",
               "gpo.sampler", "gpo.rewards", "gpo.metrics", "gpo.agent", "gpo.tools", "gpo.environments")),
    ("run", ("gpo.rollout", "gpo.generator", "gpo.async_rollout", "gpo.async_ray", "gpo.engine", "gpo.evaluate",
             "gpo.study", "gpo.launch")),
    ("cli", ("gpo.cli", "gpo.__main__")),
]


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()


def imports(name: str, path: Path) -> set[str]:
    """The project modules `name` imports anywhere in its body. `from pkg import sub` counts as importing the
    submodule `pkg.sub` when it is one (Python runs `pkg/__init__` first either way, which the package's own
    entry covers)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import gpo.ops.x` -> gpo.ops
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: imports(name, path) for name, path in MODULES.items()}


def layer_of(name: str) -> int:
    best, depth = None, -1
    for i, (_, members) in enumerate(LAYERS):
        for member in members:
            if (name == member or name.startswith(member + ".")) and len(member) > depth:
                best, depth = i, len(member)
    if best is None:
        raise AssertionError(f"{name} sits in no layer: add it to LAYERS here and to docs/architecture.md")
    return best


def test_pyproject_maps_the_folders_as_assumed_here():
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {v: k for k, v in package_dir.items()} == FOLDERS


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_a_higher_layer(name):
    mine = layer_of(name)
    upward = sorted(t for t in GRAPH[name] if layer_of(t) > mine)
    assert not upward, (f"{name} (layer {LAYERS[mine][0]}) imports "
                        + ", ".join(f"{t} ({LAYERS[layer_of(t)][0]})" for t in upward))


@pytest.mark.parametrize("name", [m for m in sorted(MODULES) if m.startswith(COMPONENT_PACKAGES)])
def test_a_component_folder_imports_no_other_component_folder(name):
    own = next(p for p in COMPONENT_PACKAGES if name == p or name.startswith(p + "."))
    others = sorted(t for t in GRAPH[name] if t.startswith(COMPONENT_PACKAGES) and not t.startswith(own))
    assert not others, f"{name} imports {', '.join(others)}"


def test_the_core_imports_no_component():
    core = [m for m in MODULES if not m.startswith(COMPONENT_PACKAGES)]
    found = {m: sorted(t for t in GRAPH[m] if t.startswith(COMPONENT_PACKAGES)) for m in core}
    assert not {m: t for m, t in found.items() if t}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The checks themselves: a made-up graph with a cycle is caught, and the real graph is not empty."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("gpo.engine") > layer_of("gpo.config") > layer_of("gpo.pruners.topk") > layer_of("gpo.ops")
    assert "gpo.rollout" in GRAPH["gpo.engine"] and "gpo.ops" in GRAPH["gpo.metrics"]
