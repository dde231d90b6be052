"""Tools the model calls (`task.tools=[calculator, my_pkg.tools:search]`), in TRL's convention.

A tool is a plain Python function with type hints and a Google-style docstring (a description, then `Args:` with a
line per parameter); transformers' `get_json_schema` turns it into the JSON schema the chat template shows the
model. `calculator` names the built-in one (gpo/tasks/calculator.py). `load_tools` checks all this when the run
is composed, so a tool that does not import or cannot be described is a one-line error naming `task.tools`.

A model turn calls tools by writing blocks in the Qwen2.5 / Hermes layout, which `parse_tool_calls` reads and
`tools_system_prompt` teaches where the chat template cannot show tools:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "1234 * 5678"}}
    </tool_call>

Parsing only reads JSON: nothing the model writes is evaluated, and the only code a call runs is the registered
function, given the call's arguments once they fit its schema (required and known names, JSON types).

`ToolRunner` runs calls in worker processes (spawned, so they share no state with the trainer; each imports the
tools once), so that a tool that hangs or crashes cannot take the run down:
- a call is bounded by `timeout_s` as gpo/user_code.py counts it: the worker's CPU time while it computes, wall
  time while it waits, and a wall backstop of `WALL_FACTOR` times the bound whatever it does. A call that overruns
  has its worker killed (not abandoned: a process can be stopped, a thread cannot) and replaced;
- a worker that dies in a call (os._exit, a segfault, out of memory) is replaced;
- either way the call gets a failed result and the next call runs on a fresh worker.
Workers are daemon processes, which end with the run: a tool may start programs (`subprocess`), not
`multiprocessing` processes of its own.

Every call gets a `ToolResult`, whose `content` is what the model sees: the tool's text (a number, bool, dict or
list as JSON), or `{"error": "..."}` saying briefly what went wrong (malformed call, unknown tool, wrong arguments,
the exception's type and message, an overrun, a crash, a result that is not text). `failed` marks the latter for
`tool/failures`; `seconds` is the wall time spent (a metric only, never a bound).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from gpo.errors import UserError
from gpo.user_code import POLL_S, Watch, load_object, process_cpu_seconds, stop_worker

BUILTIN = {"calculator": "gpo.tasks.calculator:calculator"}  # spec aliases for the tools gpo ships
STARTUP_S = 300.0  # a worker that cannot import the tools in this time is a broken installation
STARTUP_DEATHS = 3  # workers in a row that die while importing the tools before the calls waiting fail
MESSAGE_CHARS = 500  # an error message's longest quote of what the model or a tool wrote
TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str  # the function's name, what the model calls
    spec: str  # "module:function" as the user wrote it, or "calculator" (a built-in alias)
    schema: dict  # what transformers.utils.get_json_schema gives: {"type": "function", "function": {...}}


@dataclass(frozen=True)
class ToolCall:
    name: str | None  # None when the block could not be parsed
    arguments: dict | None
    error: str | None  # why the call is malformed, else None


@dataclass(frozen=True)
class ToolResult:
    name: str  # the tool called ("" if unknown or malformed)
    content: str  # the text the model sees: the tool's output, or a JSON {"error": "..."} message
    failed: bool  # raised, overran, crashed, malformed, unknown tool, wrong arguments, a result that is not text
    seconds: float  # wall time spent on it (a metric only; never a bound)


# --- loading ----------------------------------------------------------------------------------------------------


def load_tools(specs: Sequence[str], key: str = "task.tools") -> list[Tool]:
    """Each spec's function, checked to be a plain function the model can be shown; names must be distinct."""
    tools: list[Tool] = []
    by_name: dict[str, str] = {}
    for spec in specs:
        fn = load_object(BUILTIN.get(spec, spec), key, "my_pkg.tools:search")
        if not inspect.isfunction(fn):
            raise UserError(f"{key}: `{spec}` is {_a(fn)}, not a plain function (`def name(arg: type) -> str` "
                            "with a docstring).")
        schema = describe(fn, spec, key)
        name = schema["function"]["name"]
        if name in by_name:
            raise UserError(f"{key}: `{by_name[name]}` and `{spec}` are both named `{name}`: the model calls tools "
                            "by name, so each needs its own.")
        by_name[name] = spec
        tools.append(Tool(name, spec, schema))
    return tools


def describe(fn: Callable[..., Any], spec: str, key: str) -> dict:
    """The JSON schema of `fn` (a function, or a bound method: no `self`), or a UserError saying what to add."""
    how = ("Give every parameter a type hint and the function a Google-style docstring: a one-line description, "
           "then `Args:` with a line `name: what it is` for each parameter.")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as exc:
        raise UserError(f"{key}: cannot read the signature of `{spec}`: {exc}.") from exc
    unnamed = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY)]
    if unnamed:
        raise UserError(f"{key}: `{spec}` takes {', '.join(f'`{n}`' for n in unnamed)}, which a tool call cannot "
                        "pass: the model gives arguments by name, so every parameter must be a named one.")
    from transformers.utils import get_json_schema  # here: importing transformers takes seconds

    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers' TypeHintParsingException, DocstringParsingException and the like
        raise UserError(f"{key}: cannot describe `{spec}` to the model: {exc}. {how}") from exc
    if not schema["function"].get("description", "").strip():
        raise UserError(f"{key}: `{spec}` has no description in its docstring. {how}")
    return schema


# --- parsing ----------------------------------------------------------------------------------------------------


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call>...</tool_call> block of a model turn, in order; an opening tag never closed is one
    malformed call (the turn ran out of tokens, or the model lost the layout). No block: []."""
    calls: list[ToolCall] = []
    start = text.find(TAG_OPEN)
    while start != -1:
        end = text.find(TAG_CLOSE, start + len(TAG_OPEN))
        if end == -1:
            calls.append(ToolCall(None, None, f"{TAG_OPEN} is never closed by {TAG_CLOSE}"))
            break
        calls.append(_parse_block(text[start + len(TAG_OPEN):end]))
        start = text.find(TAG_OPEN, end + len(TAG_CLOSE))
    return calls


def _parse_block(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested thousands deep
        return ToolCall(None, None, f"the call is not valid JSON ({_short(str(exc))})")
    if not isinstance(data, dict):
        return ToolCall(None, None, 'the call is not a JSON object {"name": ..., "arguments": {...}}')
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, 'the call has no "name" (a string)')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return ToolCall(name, None, '"arguments" is a string that is not JSON')
    if not isinstance(arguments, dict):
        return ToolCall(name, None, '"arguments" is not a JSON object')
    return ToolCall(name, arguments, None)


def tools_system_prompt(schemas: Sequence[dict]) -> str:
    """How a model whose chat template does not render tools (SmolLM2's) learns of them: the system prompt."""
    listed = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return (
        "You have tools you can use. Each is described by a JSON schema:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "To use a tool, write a block like this one, with the tool's name and its arguments as a JSON object:\n"
        f'{TAG_OPEN}\n{{"name": "tool_name", "arguments": {{"argument_name": "value"}}}}\n{TAG_CLOSE}\n'
        "You may write several such blocks in one turn. The results come back in a `tool` turn, each as "
        "<tool_response>...</tool_response>, and you then continue. When you need no tool, answer without "
        "calling one."
    )


# --- checking a call and turning what a tool returned into text -------------------------------------------------


def check_call(call: ToolCall, schemas: Mapping[str, dict]) -> ToolResult | None:
    """A failed result for a call that must not run (malformed, unknown tool, wrong arguments), else None."""
    if call.error is not None or call.name is None or call.arguments is None:
        return failed("", f"malformed tool call: {call.error or 'no name'}")
    if call.name not in schemas:
        known = ", ".join(f"`{n}`" for n in sorted(schemas)) or "none"
        return failed("", f"unknown tool `{_short(call.name)}`; the tools are {known}")
    problem = _argument_problem(call.name, call.arguments, schemas[call.name]["function"].get("parameters", {}))
    return None if problem is None else failed(call.name, problem)


def _argument_problem(name: str, arguments: dict, parameters: dict) -> str | None:
    properties = parameters.get("properties", {})
    missing = [p for p in parameters.get("required", []) if p not in arguments]
    if missing:
        return f"tool `{name}` is missing the argument {', '.join(f'`{p}`' for p in missing)}"
    unknown = [a for a in arguments if a not in properties]
    if unknown:
        takes = ", ".join(f"`{p}`" for p in properties) or "none"
        return f"tool `{name}` has no argument {', '.join(f'`{_short(a, 80)}`' for a in unknown)}; it takes {takes}"
    for arg, value in arguments.items():
        if not _fits(value, properties[arg]):
            return f"tool `{name}`: argument `{arg}` must be {_wanted(properties[arg])}, not {_json_type(value)}"
    return None


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
    "object": (dict,), "null": (type(None),)}


def _fits(value: Any, schema: dict) -> bool:
    """Whether a JSON value fits a parameter's schema as get_json_schema writes it (type, nullable, enum, items)."""
    if value is None and schema.get("nullable"):
        return True
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "anyOf" in schema:
        return any(_fits(value, option) for option in schema["anyOf"])
    kinds = schema.get("type")
    if kinds is None:  # Any, or a type the schema leaves open: the tool decides
        return True
    for kind in [kinds] if isinstance(kinds, str) else kinds:
        if kind not in _JSON_TYPES:
            return True
        if isinstance(value, bool) and kind in ("integer", "number"):  # JSON's true is no number
            continue
        if isinstance(value, _JSON_TYPES[kind]):
            items = schema.get("items")
            if isinstance(value, list) and isinstance(items, dict) and not all(_fits(v, items) for v in value):
                continue
            return True
    return False


def _wanted(schema: dict) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    kinds = schema.get("type", "any")
    text = kinds if isinstance(kinds, str) else " or ".join(kinds)
    items = schema.get("items")
    if text == "array" and isinstance(items, dict) and "type" in items:
        text += " of " + _wanted(items)
    return text + (" or null" if schema.get("nullable") else "")


def _json_type(value: Any) -> str:
    if isinstance(value, list) and value:
        return "array of " + " and ".join(sorted({_json_type(v).partition(" ")[0] for v in value}))
    for kind in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if isinstance(value, _JSON_TYPES[kind]):
            return kind
    return type(value).__name__


def result_text(name: str, value: Any) -> tuple[str, bool]:
    """What the model sees of a tool's return value, and whether that is a failure (not text)."""
    if isinstance(value, str):
        return value, False
    if isinstance(value, (bool, int, float, dict, list)):
        try:
            return json.dumps(value, ensure_ascii=False), False
        except (TypeError, ValueError, RecursionError) as exc:
            return error_content(f"tool `{name}` returned a {type(value).__name__} that is not JSON ({exc})"), True
    return error_content(f"tool `{name}` returned {_a(value)}, not text"), True


def invoke(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, awaited when it is a coroutine function (TRL takes async tools too)."""
    value = fn(*args, **kwargs)
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def raised(name: str, exc: BaseException) -> str:
    """The error a tool's exception becomes: its type and message, no traceback."""
    return error_content(f"tool `{name}` raised {type(exc).__name__}: {_short(str(exc))}")


def overran(name: str, timeout_s: float, why: str, fate: str) -> str:
    return error_content(f"tool `{name}` did not return within {timeout_s:g} s ({why}) and was {fate}")


def failed(name: str, message: str, seconds: float = 0.0) -> ToolResult:
    return ToolResult(name, error_content(message), True, seconds)


def error_content(message: str) -> str:
    return json.dumps({"error": message}, ensure_ascii=False)


def _a(value: Any) -> str:
    """"None", "an int", "a set": what a value is, for a message."""
    if value is None:
        return "None"
    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _short(text: str, chars: int = MESSAGE_CHARS) -> str:
    return text if len(text) <= chars else text[:chars] + "..."


# --- running ----------------------------------------------------------------------------------------------------


class ToolRunner:
    """Runs tool calls in `workers` spawned processes, each call bounded by `timeout_s` (module docstring).

    Workers start on the first call that needs one; a killed or dead one is replaced on the spot, so its
    replacement is ready for the next call. `close` stops them (and is safe to repeat, or to call unused)."""

    def __init__(self, tools: list[Tool], timeout_s: float, workers: int = 1) -> None:
        self.timeout_s = timeout_s
        self.schemas = {t.name: t.schema for t in tools}
        self._targets = [(t.name, BUILTIN.get(t.spec, t.spec)) for t in tools]
        self._size = max(1, workers)
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._startup_deaths = 0  # workers in a row that died before they were ready

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """One result per call, in order. Never raises on what a tool does."""
        results: list[ToolResult | None] = [None] * len(calls)
        queue: deque[int] = deque()
        for i, call in enumerate(calls):
            refused = check_call(call, self.schemas)
            if refused is None:
                queue.append(i)
            else:
                results[i] = refused
        if queue:
            self._execute(calls, queue, results)
        return [r if r is not None else failed("", "the call was lost") for r in results]

    def worker_pids(self) -> list[int | None]:
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        workers, self._workers = self._workers, []
        for w in workers:
            w.stop(kill=False)

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _execute(self, calls: list[ToolCall], queue: deque[int], results: list[ToolResult | None]) -> None:
        while len(self._workers) < self._size:
            self._workers.append(_Worker(self._ctx, self._targets))
        waiting_since = time.monotonic()  # for a worker to become ready while none is
        while queue or self._busy():
            for w in list(self._workers):
                if w.ready and w.job is None and queue:
                    if not w.process.is_alive():  # it died while idle (killed, out of memory): replace it first
                        self._replace(w)
                        continue
                    i = queue.popleft()
                    if not w.assign(i, calls[i], self.timeout_s):  # it died while idle: the call never reached it
                        queue.appendleft(i)
                        self._replace(w)
            busy = self._busy()
            if any(w.ready for w in self._workers):
                waiting_since = time.monotonic()
            elif queue and time.monotonic() - waiting_since > STARTUP_S:
                self._fail_queued(calls, queue, results, f"no tool worker started within {STARTUP_S:.0f} s")
                break
            ready = wait([w.conn for w in self._workers], timeout=POLL_S if busy else 1.0) if self._workers else []
            for conn in ready:
                sender = next((w for w in self._workers if w.conn is conn), None)
                if sender is not None:  # None: no longer one of the workers (replaced since wait() returned)
                    self._receive(sender, calls, queue, results)
            for w in list(self._workers):
                if w.job is None:
                    continue
                why = w.overrun()
                if why:
                    name = calls[w.job].name or ""
                    results[w.job] = ToolResult(name, overran(name, self.timeout_s, why, "stopped"), True,
                                                w.elapsed())
                    self._replace(w)
            if not self._workers and queue:  # every worker failed to load the tools (reported in _receive)
                break

    def _busy(self) -> bool:
        return any(w.job is not None for w in self._workers)

    def _receive(self, w: _Worker, calls: list[ToolCall], queue: deque[int],
                 results: list[ToolResult | None]) -> None:
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):  # the worker died
            code = w.exit_code()
            if w.job is not None:
                name = calls[w.job].name or ""
                results[w.job] = failed(name, f"tool `{name}` crashed: its process {code}", w.elapsed())
                self._replace(w)
            elif not w.ready:  # while importing the tools: killed from outside, or every worker will end so
                self._startup_deaths += 1
                if self._startup_deaths < STARTUP_DEATHS:
                    self._replace(w)
                else:
                    self._drop(w)
                    self._fail_queued(calls, queue, results,
                                      f"the tools' worker process {code} while loading them, {STARTUP_DEATHS} times")
            else:
                self._replace(w)
            return
        if kind == "ready":
            w.ready = True
            self._startup_deaths = 0
        elif kind == "broken":
            self._drop(w)
            self._fail_queued(calls, queue, results, f"the tools could not be loaded in a worker process: {payload}")
        elif w.job is not None:
            content, failure = payload
            results[w.job] = ToolResult(calls[w.job].name or "", content, failure, w.elapsed())
            w.job = None

    def _fail_queued(self, calls: list[ToolCall], queue: deque[int], results: list[ToolResult | None],
                     message: str) -> None:
        while queue:
            i = queue.popleft()
            results[i] = failed(calls[i].name or "", message)

    def _replace(self, w: _Worker) -> None:
        w.stop(kill=True)
        self._workers[self._workers.index(w)] = _Worker(self._ctx, self._targets)

    def _drop(self, w: _Worker) -> None:
        w.stop(kill=True)
        self._workers.remove(w)


@contextmanager
def _children_allowed() -> Iterator[None]:
    """Let this process start a worker even when it is itself a daemon: the generator that runs ahead of the trainer
    is one (it must end with the trainer), and multiprocessing refuses daemons children by default, lest they be
    orphaned. A tool worker is a daemon too and ends with its parent: its pipe closes and it exits."""
    me = multiprocessing.current_process()
    daemon = me._config.get("daemon", False)  # type: ignore[attr-defined]
    me._config["daemon"] = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        me._config["daemon"] = daemon  # type: ignore[attr-defined]


class _Worker:
    """One tool process and the parent's view of it."""

    def __init__(self, ctx: Any, targets: list[tuple[str, str]]) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, targets), daemon=True, name="gpo-tool")
        with _children_allowed():
            self.process.start()
        child.close()
        self.ready = False  # set when it has imported the tools
        self.job: int | None = None
        self.assigned_at = 0.0
        self.cpu_at_assign: float | None = None  # its CPU seconds when the call was handed over; None: unreadable
        self.watch: Watch | None = None

    def assign(self, index: int, call: ToolCall, timeout_s: float) -> bool:
        self.cpu_at_assign = process_cpu_seconds(self.process.pid)  # before the send: the call's work comes after
        self.assigned_at = time.monotonic()
        self.watch = Watch(timeout_s)
        try:
            self.conn.send((call.name, call.arguments))
        except OSError:
            return False
        self.job = index
        return True

    def overrun(self) -> str:
        """Why the current call has overrun its bound (gpo/user_code.py), or ""."""
        assert self.watch is not None
        cpu = None
        if self.cpu_at_assign is not None:
            now = process_cpu_seconds(self.process.pid)
            cpu = None if now is None else now - self.cpu_at_assign
        return self.watch.overrun(cpu)

    def elapsed(self) -> float:
        return time.monotonic() - self.assigned_at

    def exit_code(self) -> str:
        self.process.join(timeout=5.0)
        code = self.process.exitcode
        if code is None:
            return "stopped answering"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def stop(self, kill: bool) -> None:
        stop_worker(self.process, self.conn, kill)


def _serve(conn: Connection, targets: list[tuple[str, str]]) -> None:
    """A worker's main loop: import the tools, then run calls until told to stop (None) or the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        functions = {name: _import_tool(target) for name, target in targets}
    except BaseException as exc:
        conn.send(("broken", f"{type(exc).__name__}: {_short(str(exc))}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        name, arguments = job
        try:
            reply = result_text(name, invoke(functions[name], **arguments))
        except BaseException as exc:  # SystemExit too: a tool's exit is its failure, not the worker's
            reply = (raised(name, exc), True)
        conn.send(("result", reply))


def _import_tool(target: str) -> Callable[..., Any]:
    if target in BUILTIN.values():
        # gpo.tasks's __init__ registers every task, which imports torch: seconds and hundreds of MB per worker
        # for a calculator. The built-in tool's file imports only the standard library, so it is loaded alone.
        package, _, rest = target.rpartition(":")[0].rpartition(".")
        found = importlib.util.find_spec(package)  # the folder, without running the package's __init__
        if found is not None and found.submodule_search_locations:
            path = os.path.join(list(found.submodule_search_locations)[0], f"{rest}.py")
            spec = importlib.util.spec_from_file_location(f"_gpo_builtin_{rest}", path)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return getattr(module, target.rpartition(":")[2])
    return load_object(target, "task.tools", "my_pkg.tools:search")
