"""`math`: competition mathematics (MATH, Hendrycks et al. 2021, arXiv 2103.03874), as CPPO trains on it.

Rewards follow the CPPO paper's open-r1 MATH recipe (arXiv 2503.22342): an R1-style format
reward (1) plus accuracy (2 when math-verify judges the answer equal to the gold), weighted 1:1. Changed relative
to the reference (its sections 3 and 8): the gold comes from the explicit `answer` column instead of being parsed
out of worked solutions; the prediction is the last `\\boxed{}` (inside the `<answer>` tag when there is one)
instead of anything in the completion; `verify(gold, prediction)` is called in math-verify's documented order
(the reference reversed it in training); and an unparseable gold is counted, not rewarded with a constant.

Verification runs in a small pool of worker processes. math-verify bounds its work with `signal.alarm`, which
only works in a main thread, and logs the whole input on a timeout: a pathological completion (deeply nested
LaTeX, a huge exponent, 100 KB of braces) could otherwise stall or flood a training run. Each worker bounds
each item's time itself; a worker that overruns anyway (stuck in C code, where signals wait) is killed and
replaced by the parent. Either way the item scores 0 and counts in `verify_timeouts`. A worker that dies (killed,
out of memory on a huge expression) is replaced too; its item scores 0 and counts in `verify_workers_lost`.
`verify_failures` counts every item that scored 0 because its verification did not finish.

The time counted is the verifying process's CPU time (user + system), not wall time: an item's CPU time is what it
costs whatever else the machine runs, so a right answer is not graded wrong because the cores were busy. The
worker's own bound is a profiling timer (`ITIMER_PROF`, which counts the process's CPU time); the parent reads
the worker's CPU time (Linux: /proc/<pid>/stat; elsewhere psutil where installed) and kills it `GRACE_S` CPU
seconds past the limit. Where the parent cannot read it (no /proc and no psutil) only the worker's own timer and
the wall backstop stop an item. A worker that computes nothing at all (blocked, stopped) would never reach a CPU
bound, so the parent also kills it `WALL_FACTOR` times the CPU backstop of wall time after the item was handed
over: generous enough that only a machine more than that many times oversubscribed could turn a right answer into
a timeout. (The alternative, retrying a timed-out item once with a longer wall bound, doubles the cost of every
pathological item and still depends on the load at the retry; the CPU clock is available wherever `forkserver`
and `setitimer` are, so it is used instead.)
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from gpo.registry import register
from gpo.schema import NonNegativeInt, Positive
from gpo.tasks.answers import answer_tag, last_boxed
from gpo.tasks.base import DatasetTask, StoredSplitsConfig
from gpo.tasks.data import BadRows, DataSource
from gpo.types import Example
from gpo.user_code import process_cpu_seconds, stop_worker

SYSTEM_PROMPT = (
    "You are a helpful assistant that solves competition mathematics problems. First reason step by step "
    "inside <think> </think> tags, then write the final answer inside <answer> </answer> tags as "
    "\\boxed{...} in LaTeX, and write nothing after the answer. "
    "Layout: <think> your reasoning </think>\n<answer> \\boxed{\\frac{1}{2}} </answer>"
)
CORRECT = 2.0  # the paper's accuracy value
GRACE_S = 1.0  # CPU seconds past the worker's own limit after which the parent kills it (stuck in C code)
WALL_FACTOR = 20  # a worker is also killed after this many times its CPU backstop of wall time (blocked, stopped)
POLL_S = 0.1  # how often the parent reads the CPU time of the workers that are busy
STARTUP_S = 300.0  # a worker that cannot import math-verify in this time is a broken installation

# Statuses a verification comes back with; every one but "ok" scores 0.
OK, TIMEOUT, ERROR, WORKER_LOST, GOLD_UNPARSED = "ok", "timeout", "error", "worker_lost", "gold_unparsed"
Verdict = tuple[str, bool]  # (status, correct)


@dataclass(frozen=True)
class MathConfig(StoredSplitsConfig):
    train: DataSource = DataSource("DigitalLearningGmbH/MATH-lighteval", None, "train")
    test: DataSource = DataSource("HuggingFaceH4/MATH-500", None, "test")
    # MATH train holds two multiple-choice problems whose final answer is empty (rows 5342 and 5344 of the
    # a local copy): they are left out with a warning rather than refuse to train.
    bad_rows: BadRows = "skip"
    # CPU seconds the verifying process may spend on one completion (math-verify's default 5, which it counts in
    # wall time): a busy machine slows verification down without failing it (module docstring).
    verify_timeout_s: Positive = 5.0
    workers: NonNegativeInt = 0  # verification processes; 0 = the cores this process may use
    system_prompt: str = SYSTEM_PROMPT


def gold_answer(row: Example) -> str:
    """The `answer` column; Hub MATH train (MATH-lighteval) has none, so the last \\boxed{} of `solution`."""
    answer = row.get("answer")
    if isinstance(answer, str) and answer.strip():
        return answer.strip()
    return last_boxed(str(row.get("solution") or "")) or ""


def predicted_answer(completion: str) -> str | None:
    """The last \\boxed{} inside the `<answer>` tag, else the tag's content, else the completion's last \\boxed{}."""
    tag = answer_tag(completion)
    if tag is not None:
        return last_boxed(tag) or tag or None
    return last_boxed(completion) or None


@register("task", "math", config=MathConfig)
class Math(DatasetTask):
    """MATH problems: R1 format reward + math-verify accuracy, verified in time-bounded worker processes."""

    QUESTION = "problem"
    REQUIRED = ("problem",)
    LOCAL_FILES = {"train": "math/train.jsonl", "test": "math/test500.jsonl"}

    def __init__(self, cfg: MathConfig) -> None:
        super().__init__(cfg)
        self._pool: VerifierPool | None = None  # started on the first reward, then reused

    def gold(self, row: Example) -> str:
        return gold_answer(row)

    def extract(self, completion: str) -> str | None:
        return predicted_answer(completion)

    def judge(self, completions: list[str], examples: list[Example]) -> tuple[list[float], dict[str, float]]:
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
        predictions = [predicted_answer(c) for c in completions]
        if self._pool is None and any(p is not None for p in predictions):
            self._pool = VerifierPool(self.cfg.workers or available_cores(), self.cfg.verify_timeout_s)
        verdicts = verify_answers(self._pool, [ex["gold"] for ex in examples], predictions)
        return [CORRECT if correct else 0.0 for _, correct in verdicts], verify_metrics(verdicts)

    def close(self) -> None:
        """Stop the verification workers (they also stop with this process). Safe to call twice; a later reward
        or grade starts a new pool."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def verify_answers(pool: VerifierPool | None, golds: list[str], predictions: list[str | None]) -> list[Verdict]:
    """Each prediction verified against its gold in `pool`; no prediction is wrong without a verification."""
    todo = [i for i, p in enumerate(predictions) if p is not None]
    verdicts: list[Verdict] = [(OK, False)] * len(predictions)
    if todo:
        assert pool is not None, "a pool is needed to verify predictions"
        results = pool.run([(golds[i], str(predictions[i])) for i in todo])
        for i, verdict in zip(todo, results, strict=True):
            verdicts[i] = verdict
    return verdicts


def verify_metrics(verdicts: list[Verdict]) -> dict[str, float]:
    """Counts of the verifications that did not finish, and of golds math-verify could not read."""
    statuses = [status for status, _ in verdicts]
    failures = {"verify_timeouts": TIMEOUT, "verify_errors": ERROR, "verify_workers_lost": WORKER_LOST}
    metrics = {name: float(statuses.count(status)) for name, status in failures.items()}
    metrics["verify_failures"] = sum(metrics.values())
    metrics["gold_unparsed"] = float(statuses.count(GOLD_UNPARSED))
    return metrics


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# --- the worker processes ---------------------------------------------------------------------------------------


class VerifierPool:
    """`size` processes that each verify one (gold, prediction) pair at a time within `limit_s` CPU seconds.

    Workers come from a fork server that has imported math-verify once, so replacing a killed worker is a
    cheap fork rather than a fresh interpreter (and never a fork of a parent that holds model threads).
    """

    def __init__(self, size: int, limit_s: float, kill_after_s: float | None = None,
                 wall_after_s: float | None = None) -> None:
        self.limit_s = limit_s  # each worker stops its own item after this much CPU time
        # The parent's backstops: CPU seconds of the worker, and wall seconds for a worker that computes nothing.
        self.kill_after_s = limit_s + GRACE_S if kill_after_s is None else kill_after_s
        self.wall_after_s = WALL_FACTOR * self.kill_after_s if wall_after_s is None else wall_after_s
        self.backstops = {"cpu": 0, "wall": 0}  # items the parent stopped, by the bound that stopped them
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["math_verify", __name__])
        self._workers = [_Worker(self._ctx, limit_s) for _ in range(max(1, size))]

    def run(self, jobs: list[tuple[str, str]]) -> list[Verdict]:
        results: list[Verdict | None] = [None] * len(jobs)
        queue = deque(range(len(jobs)))
        started = time.monotonic()
        while queue or any(w.job is not None for w in self._workers):
            for w in self._workers:
                if w.ready and w.job is None and queue:
                    w.assign(queue.popleft(), jobs)
            busy = any(w.job is not None for w in self._workers)
            if not busy and time.monotonic() - started > STARTUP_S:
                raise RuntimeError(f"no math-verify worker started within {STARTUP_S:.0f} s")
            for conn in wait([w.conn for w in self._workers], timeout=POLL_S if busy else 1.0):
                slot = next(i for i, w in enumerate(self._workers) if w.conn is conn)
                self._receive(slot, results)
            for slot, w in enumerate(self._workers):
                if w.job is None:
                    continue
                bound = w.overrun(self.kill_after_s, self.wall_after_s)
                if bound is not None:
                    results[w.job] = (TIMEOUT, False)
                    self.backstops[bound] += 1
                    self._replace(slot)
        return [r if r is not None else (ERROR, False) for r in results]

    def worker_pids(self) -> list[int | None]:
        return [w.process.pid for w in self._workers]

    def _receive(self, slot: int, results: list[Verdict | None]) -> None:
        w = self._workers[slot]
        try:
            message = w.conn.recv()
        except (EOFError, OSError):  # the worker died (killed, or out of memory on a huge expression)
            if w.job is not None:
                results[w.job] = (WORKER_LOST, False)
            self._replace(slot)
            return
        if message == "ready":
            w.ready = True
        elif w.job is not None:
            results[w.job] = message
            w.job = None

    def _replace(self, slot: int) -> None:
        self._workers[slot].stop(kill=True)
        self._workers[slot] = _Worker(self._ctx, self.limit_s)

    def close(self) -> None:
        for w in self._workers:
            w.stop(kill=False)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _Worker:
    """One verification process and the parent's view of it."""

    def __init__(self, ctx: Any, limit_s: float) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, limit_s), daemon=True, name="gpo-math-verify")
        self.process.start()
        child.close()
        self.ready = False  # set when the worker has imported math-verify
        self.job: int | None = None
        self.assigned_at = 0.0  # wall clock (monotonic) when the job was handed over
        self.cpu_at_assign: float | None = None  # the worker's CPU seconds then; None where they cannot be read

    def assign(self, index: int, jobs: list[tuple[str, str]]) -> None:
        self.cpu_at_assign = process_cpu_seconds(self.process.pid)  # before the send: the item's work comes after
        self.assigned_at = time.monotonic()
        self.conn.send(jobs[index])
        self.job = index

    def overrun(self, cpu_s: float, wall_s: float) -> str | None:
        """The backstop the current item has passed ("cpu" or "wall"), if any."""
        if time.monotonic() - self.assigned_at > wall_s:
            return "wall"
        if self.cpu_at_assign is None:  # the CPU time cannot be read here: the worker's own timer and the wall
            return None
        cpu = process_cpu_seconds(self.process.pid)
        return "cpu" if cpu is not None and cpu - self.cpu_at_assign > cpu_s else None

    def stop(self, kill: bool) -> None:
        stop_worker(self.process, self.conn, kill)


class _ItemTimeout(BaseException):
    """Raised by the worker's timer; a BaseException so math-verify's `except Exception` cannot swallow it."""


_armed = False  # in a worker: an item is being verified, so the profiling timer's signal stops it


def _expire(signum: int, frame: Any) -> None:
    if _armed:  # a signal that arrives just after the item finished is dropped, not raised in the loop
        raise _ItemTimeout


def _serve(conn: Connection, limit_s: float) -> None:
    """Worker main loop: verify pairs until told to stop (None) or the parent goes away."""
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs the whole input on a timeout
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGPROF, _expire)
    import math_verify  # noqa: F401  (import before "ready", so the bound covers only verification)

    try:  # math-verify builds its parsers on first use: do it here rather than on the first item's time
        verify_pair("1", "1")
    except Exception:
        pass
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        gold, prediction = job
        conn.send(_bounded(gold, prediction, limit_s=limit_s))


def _bounded(gold: str, prediction: str, limit_s: float) -> Verdict:
    """`verify_pair` under a CPU-time timer that covers parsing both sides and comparing them."""
    global _armed
    try:
        _armed = True
        signal.setitimer(signal.ITIMER_PROF, limit_s)  # counts this process's user + system CPU time
        try:
            return verify_pair(gold, prediction)
        finally:
            _armed = False
            signal.setitimer(signal.ITIMER_PROF, 0)
    except _ItemTimeout:
        return (TIMEOUT, False)
    except Exception:
        return (ERROR, False)


def verify_pair(gold: str, prediction: str) -> Verdict:
    """math-verify's judgement of `prediction` against `gold`, both LaTeX answers without `$` delimiters.

    Runs without math-verify's own signal timeouts: the caller bounds the whole item (see `_bounded`).
    """
    from math_verify import verify

    gold_parsed = _parse(gold)
    if not gold_parsed:
        return (GOLD_UNPARSED, False)
    predicted = _parse(prediction)
    return (OK, bool(predicted) and verify(gold_parsed, predicted, timeout_seconds=None, raise_on_error=False))


def _parse(answer: str) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    # An answer already extracted from \boxed{} has no delimiters; re-box it so the LaTeX extractor anchors on it.
    text = answer if ("$" in answer or "\\boxed" in answer) else f"\\boxed{{{answer}}}"
    return parse(text, extraction_config=config, parsing_timeout=None, raise_on_error=False)
