"""Rules for the test suite itself, read from the source with `ast`.

1. No test file imports another (`test_*` modules): what two test files share lives in tests/kit.py.
2. No test times the machine, since the suite must pass on a slow, busy one: no comparison that involves a clock
   reading (time.time, monotonic, perf_counter, process_time and their _ns forms), a value computed from one, or a
   function that returns one; and no sleep of a second or more outside tests/plugins (whose faults simulate a hang).
   Waiting is on events, bounded only by generous hang guards passed as `timeout=` (kit.until, kit.ended).
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
CLOCKS = {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "process_time",
          "process_time_ns"}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def suite_files() -> list[Path]:
    """Every Python file of the suite but the plug-ins that runs load."""
    return sorted(p for p in TESTS.rglob("*.py") if "plugins" not in p.relative_to(TESTS).parts)


def sources_of_tests() -> list[Path]:
    return [p for p in suite_files() if p.name.startswith("test_")]


# --- rule 1: no test file imports another ---------------------------------------------------------------------


def imports_of_test_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import of a `test_*` module, by statement or by importlib/__import__ with a literal."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0].startswith("test_")]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0].startswith("test_"):
                found.append((node.lineno, node.module or ""))
            elif node.level > 0:  # from . import test_x
                found += [(node.lineno, a.name) for a in node.names if a.name.startswith("test_")]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = ast.unparse(node.func)
            target = node.args[0].value
            if name in ("importlib.import_module", "import_module", "__import__") and isinstance(target, str) and \
                    target.split(".")[0].startswith("test_"):
                found.append((node.lineno, target))
    return found


# --- rule 2: no clock in a comparison, no long sleep ------------------------------------------------------------


def _in_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of one function (or the module) without those of the functions defined inside it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _targets(node: ast.AST) -> Iterator[str]:
    if isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    elif isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
        yield ast.unparse(node)


class Clocks:
    """Where one module reads the clock: calls of time's clocks however imported, the names each function assigns
    from them (and from names so assigned), and the functions that return such a value."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.time_modules, self.clock_names, self.sleep_names = set(), set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.time_modules |= {a.asname or a.name for a in node.names if a.name == "time"}
            elif isinstance(node, ast.ImportFrom) and node.module == "time" and node.level == 0:
                self.clock_names |= {a.asname or a.name for a in node.names if a.name in CLOCKS}
                self.sleep_names |= {a.asname or a.name for a in node.names if a.name == "sleep"}
        self.scopes: list[ast.AST] = [tree, *(n for n in ast.walk(tree) if isinstance(n, SCOPES))]
        self.enclosing: dict[ast.AST, ast.AST] = {}  # a closure also sees the names its outer function assigned
        for scope in self.scopes:
            for node in _in_scope(scope):
                if isinstance(node, SCOPES):
                    self.enclosing[node] = scope
        self.functions: set[str] = set()  # names of functions whose result comes from the clock
        self.tainted: dict[ast.AST, set[str]] = {scope: set() for scope in self.scopes}
        changed = True
        while changed:  # names taint names and functions taint their callers: until nothing new is found
            changed = False
            for scope in self.scopes:
                changed |= self._spread(scope)

    def _time_call(self, node: ast.AST, names: set[str], attrs: set[str]) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Name):
            return f.id in names
        return isinstance(f, ast.Attribute) and f.attr in attrs and isinstance(f.value, ast.Name) and \
            f.value.id in self.time_modules

    def reads(self, expr: ast.AST, scope: ast.AST) -> bool:
        """Whether `expr` holds a clock reading, a name assigned from one in `scope` (or a scope around it), or a
        clock function's result."""
        tainted, outer = set(self.tainted[scope]), scope
        while outer in self.enclosing:
            outer = self.enclosing[outer]
            tainted |= self.tainted[outer]
        for node in ast.walk(expr):
            if self._time_call(node, self.clock_names, CLOCKS):
                return True
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.functions:
                return True
            if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)) and \
                    ast.unparse(node) in tainted:
                return True
        return False

    def _spread(self, scope: ast.AST) -> bool:
        before = (len(self.tainted[scope]), len(self.functions))
        for node in _in_scope(scope):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None \
                    and self.reads(node.value, scope):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    self.tainted[scope] |= set(_targets(target))
            elif isinstance(node, ast.Return) and node.value is not None and self.reads(node.value, scope) and \
                    isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.add(scope.name)
        return (len(self.tainted[scope]), len(self.functions)) != before

    def timed_comparisons(self) -> list[tuple[int, str]]:
        return sorted((node.lineno, ast.unparse(node)) for scope in self.scopes for node in _in_scope(scope)
                      if isinstance(node, ast.Compare) and
                      any(self.reads(side, scope) for side in [node.left, *node.comparators]))

    def long_sleeps(self) -> list[tuple[int, str]]:
        return [(node.lineno, ast.unparse(node)) for node in ast.walk(self.tree)
                if isinstance(node, ast.Call) and self._time_call(node, self.sleep_names, {"sleep"}) and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, (int, float))
                and node.args[0].value >= 1]


def timing(source: str) -> list[tuple[int, str]]:
    clocks = Clocks(ast.parse(source))
    return sorted(clocks.timed_comparisons() + clocks.long_sleeps())


# --- the rules on the suite -------------------------------------------------------------------------------------


def test_the_walk_covers_the_suite():
    names = {p.relative_to(TESTS).as_posix() for p in suite_files()}
    assert {"kit.py", "conftest.py", "unit/test_suite_rules.py", "integration/test_resume.py"} <= names
    assert not any(n.startswith("plugins/") for n in names)
    assert len(sources_of_tests()) > 50


def test_no_test_file_imports_another():
    found = {p.relative_to(REPO).as_posix(): hits for p in suite_files()
             if (hits := imports_of_test_modules(ast.parse(p.read_text(), str(p))))}
    assert found == {}, f"move what these import into tests/kit.py: {found}"


def test_no_two_test_files_share_a_name():
    """Test modules are imported by their bare name (no packages under tests/): two files of one name in the two
    tiers make pytest refuse the second one at collection, which only a run of both tiers shows."""
    names: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert not {name: where for name, where in names.items() if len(where) > 1}


def test_no_test_depends_on_how_fast_the_machine_is():
    found = {p.relative_to(REPO).as_posix(): hits for p in suite_files() if (hits := timing(p.read_text()))}
    assert found == {}, ("wait for an event (kit.until) with a hang guard given as `timeout=`, count what the time "
                         f"bound stood for, or move the timing to bench/: {found}")


# --- the rules catch what they are meant to, and only that ------------------------------------------------------


def test_imports_of_test_modules_are_caught():
    source = textwrap.dedent("""
        import test_multiprocess
        from test_ops import micro_batch
        from test_async.sub import engine
        from . import test_faults
        importlib.import_module("test_resume")
        from kit import micro_batch
        import testing_helpers
        from gpo import test_utils
        importlib.import_module("kit")
    """)
    assert imports_of_test_modules(ast.parse(source)) == [
        (2, "test_multiprocess"), (3, "test_ops"), (4, "test_async.sub"), (5, "test_faults"), (6, "test_resume")]


def test_timed_assertions_polls_and_sleeps_are_caught():
    source = textwrap.dedent("""
        import time
        from time import monotonic as now, sleep

        def measured(f):
            began = time.perf_counter()
            f()
            return time.perf_counter() - began

        def test_a():
            started = time.monotonic()
            work()
            assert time.monotonic() - started < 30

        def test_b():
            start = time.perf_counter()
            work()
            elapsed = time.perf_counter() - start
            assert elapsed < 12.0

        def test_c(proc):
            deadline = now() + 20
            while proc.poll() is None and now() < deadline:
                sleep(0.2)

        def test_d():
            assert measured(work) < 2
            status, out, seconds = measured(work), "", 0
            assert seconds <= 120
            time.sleep(3)
            sleep(1)

        def test_e():
            deadline = time.time() + 60
            until(lambda: done() or time.time() > deadline)
            until(lambda: deadline < 5)
    """)
    assert [line for line, _ in timing(source)] == [13, 19, 23, 27, 29, 30, 31, 35, 36]


def test_what_does_not_time_the_machine_passes():
    source = textwrap.dedent("""
        import time

        def test_ok(proc, metrics, record):
            out, _ = proc.communicate(timeout=900)
            time.sleep(0.2)
            stamp = time.time()
            record["time"] = stamp
            assert metrics["time/step"] > 0 and out != ""

        def test_other_scope(record):
            stamp = record["stamp"]  # the same name as above, not a clock reading here
            assert stamp == 3
    """)
    assert timing(source) == []
