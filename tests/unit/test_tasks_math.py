"""MATH: math-verify accuracy in CPU-time-bounded worker processes, format reward, real MATH-500 rows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpo import registry
from gpo.errors import UserError
from gpo.tasks.math import TIMEOUT, Math, MathConfig, VerifierPool, predicted_answer, process_cpu_seconds
from kit import crowded_core

# Per-item CPU seconds in these tests (the default is 5). The costliest pair of the table below takes about 0.4 CPU s
# (the costliest right one 0.2) on a 2020s x86 core: 2 leaves room for a CPU several times slower.
LIMIT_S = 2.0
ADVERSARIAL_LIMIT_S = 0.5  # the adversarial test's one right answer ("3") costs about 0.01 CPU s
HANG_S = 600.0  # a wall bound that only stops a broken test


@pytest.fixture(scope="module")
def task() -> Math:
    task = Math(MathConfig(workers=2, verify_timeout_s=LIMIT_S))
    yield task
    task.close()


def boxed(answer: str) -> str:
    return f"<think>work</think>\n<answer>\\boxed{{{answer}}}</answer>"


# (gold as in MATH's `answer` column, what the model boxes, equal?)
EQUIVALENCE = [
    # fractions
    ("\\frac{1}{2}", "\\frac12", True),
    ("\\frac{1}{2}", "0.5", True),
    ("\\frac{1}{2}", "1/2", True),
    ("\\frac{1}{2}", "\\dfrac{1}{2}", True),
    ("\\frac{1}{2}", "\\tfrac{1}{2}", True),
    ("\\frac{1}{2}", "\\frac{2}{4}", True),
    ("\\frac{1}{2}", "\\frac{1}{3}", False),
    ("\\frac{3}{4}", "0.75", True),
    ("\\frac{3}{4}", "0.7", False),
    ("-\\frac{2}{3}", "\\frac{-2}{3}", True),
    ("-\\frac{2}{3}", "\\frac{2}{3}", False),
    ("\\dfrac{7}{3}", "2\\frac{1}{3}", True),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}", True),
    ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2", True),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    # integers and decimals
    ("18", "18", True),
    ("18", "18.0", True),
    ("18", "17", False),
    ("-5", "-5", True),
    ("-5", "5", False),
    ("1000", "1,000", True),
    ("0.25", "\\frac{1}{4}", True),
    ("3.14", "3.14", True),
    ("10", "10\\%", True),
    # radicals, pi, powers
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("2\\sqrt{2}", "2\\sqrt{3}", False),
    ("\\pi", "\\pi", True),
    ("2\\pi", "\\pi \\cdot 2", True),
    ("\\frac{\\pi}{2}", "\\frac{1}{2}\\pi", True),
    ("2^{10}", "1024", True),
    ("3^4", "81", True),
    ("e^{2}", "e^2", True),
    # algebraic expressions
    ("p - q", "-q + p", True),
    ("p - q", "q - p", False),
    ("x^2+2x+1", "(x+1)^2", True),
    ("2x+3", "3+2x", True),
    ("2x+3", "2x-3", False),
    ("\\frac{x}{2}", "0.5x", True),
    # equations: the model writes "x = 3"
    ("3", "x = 3", True),
    ("3", "x = 4", False),
    # intervals
    ("(2, 5]", "(2,5]", True),
    ("(2, 5]", "(2,5)", False),
    ("[-1, \\infty)", "[-1,\\infty)", True),
    ("(-\\infty, 0) \\cup (1, \\infty)", "(-\\infty,0)\\cup(1,\\infty)", True),
    ("(-\\infty, 0) \\cup (1, \\infty)", "(-\\infty,0]\\cup(1,\\infty)", False),
    # tuples and points
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})", True),
    ("(1, 2)", "(1,2)", True),
    ("(1, 2)", "(2,1)", False),
    ("(1, -2, 3)", "(1,-2,3)", True),
    # sets and lists of solutions
    ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}", True),
    ("\\{1, 2\\}", "\\{1, 3\\}", False),
    ("1, 2", "2, 1", True),
    ("-2, 3", "3, -2", True),
    # units and decorations
    ("5", "5 \\text{ cm}", True),
    ("12", "12\\text{ dollars}", True),
    ("90^\\circ", "90", True),
    ("45", "45^\\circ", True),
    ("\\$ 20", "20", True),
    ("20", "21 \\text{ cm}", False),
    # matrices and vectors
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}2\\\\1\\end{pmatrix}", False),
    # text answers, infinity
    ("\\text{(C)}", "\\text{(C)}", True),
    ("\\text{Evelyn}", "\\text{Evelyn}", True),
    ("\\infty", "\\infty", True),
]


def test_math_verify_equivalences(task: Math) -> None:
    assert len(EQUIVALENCE) >= 60
    examples = [{"gold": gold} for gold, _, _ in EQUIVALENCE]
    grades = task.grade([boxed(p) for _, p, _ in EQUIVALENCE], examples)
    wrong = [(g, p, want) for (g, p, want), grade in zip(EQUIVALENCE, grades) if grade.correct is not want]
    assert wrong == []
    # accuracy is 2 per correct answer, as in the paper
    rewards = task.reward([boxed(p) for _, p, _ in EQUIVALENCE], examples)
    assert rewards.components["accuracy"] == [2.0 if want else 0.0 for _, _, want in EQUIVALENCE]
    assert rewards.metrics["verify_timeouts"] == 0


def test_equivalence_verdicts_do_not_depend_on_the_load(task: Math, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole table again, each worker given at most a fifth of one core: the same verdicts and no timeouts, since
    the bound counts the workers' CPU time (a wall-time bound of LIMIT_S would be overrun on the costliest pairs)."""
    examples = [{"gold": gold} for gold, _, _ in EQUIVALENCE]
    task.reward([boxed("1")], [{"gold": "1"}])  # the pool is up, so its workers can be crowded
    workers = [pid for pid in task._pool.worker_pids() if pid is not None]
    fork_server = psutil.Process(workers[0]).ppid()  # replacements would fork from it, onto the crowded core too
    monkeypatch.setattr(task._pool, "wall_after_s", HANG_S)  # the wall backstop only stops a broken test here
    with crowded_core([*workers, fork_server]):
        rewards = task.reward([boxed(p) for _, p, _ in EQUIVALENCE], examples)
    wrong = [(g, p, want) for (g, p, want), acc in zip(EQUIVALENCE, rewards.components["accuracy"])
             if (acc == 2.0) is not want]
    assert wrong == []
    assert rewards.metrics["verify_failures"] == 0 and task._pool.backstops == {"cpu": 0, "wall": 0}


def test_prediction_extraction() -> None:
    assert predicted_answer("<answer>so \\boxed{1} no \\boxed{2}</answer>") == "2"
    assert predicted_answer("<answer> 7 </answer>") == "7"  # a bare answer tag is taken whole
    assert predicted_answer("thinking \\boxed{3} ... \\boxed{4}") == "4"  # no tag: the last box
    assert predicted_answer("\\boxed{4} and then <answer></answer>") is None  # an empty tag is the answer given
    assert predicted_answer("no answer at all") is None


# MATH-500 rows: 0 gold "\left( 3, \frac{\pi}{2} \right)", 2 gold "\frac{14}{3}", 7 gold "90^\circ".
@pytest.mark.parametrize(
    "row, completion, fmt, acc",
    [
        (0, "<think>r = 3</think>\n<answer>\\boxed{(3, \\frac{\\pi}{2})}</answer>", 1.0, 2.0),  # 1 + 2 = 3
        (0, "<think>r = 3</think>\n<answer>$(3, \\pi/2)$</answer>", 1.0, 2.0),  # delimited LaTeX in the tag
        (0, "r = 3, so \\boxed{(3, \\frac{\\pi}{2})}", 0.0, 2.0),  # right, unformatted: 2
        (0, "<think>r = 3</think>\n<answer>\\boxed{(3, \\pi)}</answer>", 1.0, 0.0),  # wrong angle: 1
        (0, "<think>r = 3 so \\boxed{(3, \\frac{\\pi", 0.0, 0.0),  # truncated inside the box
        (2, "<think>x</think>\n<answer>\\frac{14}{3}</answer>", 1.0, 2.0),  # a bare answer is boxed for parsing
        (2, "<think>x</think>\n<answer>\\boxed{4.67}</answer>", 1.0, 0.0),  # rounded: not equal
        (7, "<think>x</think>\n<answer>\\boxed{90}</answer>\nDone.", 0.0, 2.0),  # trailing text fails format
    ],
)
def test_reward_table_on_math500(task: Math, shared_data: Path, row: int, completion: str, fmt: float,
                                 acc: float) -> None:
    task_local = Math(MathConfig(data_dir=str(shared_data), workers=1))
    example = task_local.load("test")[row]
    rewards = task.reward([completion], [example])
    assert rewards.components == {"format": [fmt], "accuracy": [acc]}
    assert rewards.total == [fmt + acc]


def test_loads_math500_and_train_with_bad_rows_skipped(shared_data: Path) -> None:
    with pytest.raises(UserError, match=r"math/train\.jsonl: row 5342 has no final answer"):
        Math(MathConfig(data_dir=str(shared_data), bad_rows="error")).load("train")
    with pytest.warns(UserWarning, match=r"skipped 2 bad rows \(numbers \[5342, 5344\]\)"):
        task = Math(MathConfig(data_dir=str(shared_data)))  # skip is the default (configs/task/math.yaml's before)
        # 7,500 train rows - 2 without an answer - 256 for validation = 7,242
        assert (len(task.load("train")), len(task.load("validation")), len(task.load("test"))) == (7242, 256, 500)


def test_hub_train_rows_take_gold_from_the_boxed_solution(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.delenv("GPO_DATA_DIR", raising=False)
    rows = [{"problem": f"p{i}", "solution": f"so \\boxed{{{i}}}.", "level": "Level 1", "type": "Algebra"}
            for i in range(4)]  # MATH-lighteval has no `answer` column
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name=None, split=None: rows)
    task = Math(MathConfig(validation_size=1))
    assert sorted(ex["gold"] for ex in task.load("train") + list(task.load("validation"))) == ["0", "1", "2", "3"]


ADVERSARIAL = [
    "\\boxed{" + "{" * 50_000 + "}" * 50_000 + "}",  # 100 KB of balanced braces
    "<answer>\\boxed{" + "\\frac{1}{" * 400 + "2" + "}" * 400 + "}</answer>",  # deeply nested LaTeX
    "\\boxed{9^{9^{9^{9^{9}}}}}",  # a tower of exponents
    "\\boxed{10^{10^{10^{10}}}!}",  # factorial of a huge power
    "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",  # deeply nested parentheses
    "\\boxed{" + "x+" * 20_000 + "x}",  # a 40 KB sum
]


def test_adversarial_completions_are_stopped_and_counted() -> None:
    task = Math(MathConfig(workers=2, verify_timeout_s=ADVERSARIAL_LIMIT_S))
    try:
        rewards = task.reward(ADVERSARIAL + [boxed("3")], [{"gold": "3"}] * (len(ADVERSARIAL) + 1))
        assert rewards.components["accuracy"] == [0.0] * len(ADVERSARIAL) + [2.0]
        assert rewards.metrics["verify_timeouts"] >= 1  # at least the 100 KB of braces overruns the limit
        assert rewards.metrics["verify_failures"] == rewards.metrics["verify_timeouts"]  # none lost or raising
        braces = task.reward([ADVERSARIAL[0]], [{"gold": "1"}])
        assert braces.metrics["verify_timeouts"] == 1 and braces.components["accuracy"] == [0.0]
    finally:
        task.close()


def test_parent_kills_and_replaces_a_worker_that_overruns_its_cpu_time() -> None:
    # The worker's own timer is set far off (60 CPU s) and the wall backstop further, so only the parent's reading of
    # the worker's CPU time (1 s) can stop the item.
    pool = VerifierPool(size=1, limit_s=60.0, kill_after_s=1.0, wall_after_s=HANG_S)
    try:
        first = pool.worker_pids()
        verdicts = pool.run([("1", "{" * 50_000 + "}" * 50_000), ("1", "1")])
        assert verdicts == [(TIMEOUT, False), ("ok", True)]  # the replacement verifies the next item
        assert pool.backstops == {"cpu": 1, "wall": 0}
        assert pool.worker_pids() != first
    finally:
        pool.close()


def test_a_worker_that_computes_nothing_is_stopped_by_the_wall_backstop() -> None:
    # A stopped process uses no CPU, so no CPU bound can ever stop its item: only the wall backstop (1 s here).
    pool = VerifierPool(size=1, limit_s=60.0, kill_after_s=60.0, wall_after_s=1.0)
    try:
        assert pool.run([("1", "1")]) == [("ok", True)]  # the worker is up and idle
        (stopped,) = pool.worker_pids()
        assert stopped is not None
        os.kill(stopped, signal.SIGSTOP)
        assert pool.run([("2", "2"), ("3", "3")]) == [(TIMEOUT, False), ("ok", True)]
        assert pool.backstops == {"cpu": 0, "wall": 1}
        assert pool.worker_pids() != [stopped]
    finally:
        pool.close()


def test_a_process_cpu_time_is_read_from_outside_and_a_gone_process_reads_none() -> None:
    before = process_cpu_seconds(os.getpid())
    start = time.thread_time()
    while time.thread_time() - start < 0.3:  # 0.3 s of this thread's CPU time, however long that takes
        pass
    after = process_cpu_seconds(os.getpid())
    assert before is not None and after is not None
    assert after - before >= 0.3 - 0.02  # the process's time holds this thread's (to a clock tick either side)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now (Linux hands pids out in order, so none new)
    assert process_cpu_seconds(gone.pid) is None


def test_bad_config() -> None:
    """Ranges are checked as the composer checks `task=math task.KEY=...` (the config's annotations)."""
    build = registry.get("task", "math").build
    with pytest.raises(UserError, match="verify_timeout_s"):
        build({"verify_timeout_s": 0})
    with pytest.raises(UserError, match="workers"):
        build({"workers": -1})


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_close_stops_the_verification_workers_and_twice_is_harmless() -> None:
    task = Math(MathConfig(workers=2, verify_timeout_s=LIMIT_S))
    assert task.reward([boxed("2")], [{"gold": "2"}]).components["accuracy"] == [2.0]  # starts the pool
    pids = task._pool.worker_pids()
    assert len(pids) == 2 and all(_running(pid) for pid in pids)
    task.close()  # joins each worker (killing one that does not stop when asked)
    assert not any(_running(pid) for pid in pids)
    task.close()  # nothing left to stop: a no-op
    # A task used after close() starts new workers rather than failing.
    assert task.reward([boxed("3")], [{"gold": "2"}]).components["accuracy"] == [0.0]
    assert set(task._pool.worker_pids()).isdisjoint(pids)
    task.close()
