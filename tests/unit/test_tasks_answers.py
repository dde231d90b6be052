"""Answer extraction shared by the tasks: the CPPO code's format and number bugs (arXiv 2503.22342), fixed."""

from __future__ import annotations

import time

import pytest

from gpo.tasks.answers import answer_tag, clean_number_text, last_boxed, last_number, numbers, r1_formatted, same_number


@pytest.mark.parametrize(
    "text, ok",
    [
        ("<think>2+2=4</think>\n<answer>4</answer>", True),
        ("<think>a</think><answer>4</answer>", True),  # the reference demanded exactly one "\n" between the blocks
        ("  <think>a</think>\n\n<answer> 4 </answer>\n", True),  # surrounding whitespace is harmless
        ("<think>a</think>\n<answer>4</answer>\nThanks!", False),  # trailing text (the reference's `$` let it pass)
        ("<think>a</think>\n<answer>4</answer>\n<answer>5</answer>", False),  # a second answer block
        ("Sure. <think>a</think>\n<answer>4</answer>", False),  # text before the reasoning
        ("<answer>4</answer>", False),  # no reasoning block
        ("<think>a</think>\n<answer>  </answer>", False),  # empty answer
        ("<think>a</think>\n<answer>4", False),  # truncated before </answer>
        ("<answer>4</answer><think>a</think>", False),  # wrong order
    ],
)
def test_r1_format(text: str, ok: bool) -> None:
    assert r1_formatted(text) is ok


def test_answer_tag_takes_the_last_closed_block() -> None:
    assert answer_tag("<answer> 1 </answer> then <answer>2</answer>") == "2"
    assert answer_tag("<answer>1</answer> then <answer>2") == "1"  # the unclosed (truncated) block is ignored
    assert answer_tag("no tags at all") is None
    assert answer_tag("</answer> only a closing tag") is None


def test_last_boxed_balances_braces() -> None:
    assert last_boxed(r"so \boxed{1} or rather \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed {x^{2}}") == "x^{2}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{a} \boxed{}") == ""  # the last box is empty: callers treat "" as no answer
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # cut off inside the box
    assert last_boxed(r"\boxed 5") is None  # no braced argument
    assert last_boxed("nothing boxed") is None


@pytest.mark.parametrize(
    "raw, clean",
    [("$1,234.", "1234"), ("\u22125", "-5"), (" 70,000 dollars", "70000 dollars"), ("3,4", "3,4")],
)
def test_clean_number_text(raw: str, clean: str) -> None:
    assert clean_number_text(raw) == clean


def test_numbers_keep_their_sign() -> None:
    assert numbers("from -3 to 4.5 and .5") == ["-3", "4.5", ".5"]  # the reference's regex dropped the "-"
    assert last_number("it is -12 degrees") == "-12"
    assert last_number("no digits") is None


def test_same_number_compares_values_not_strings() -> None:
    assert same_number("18.00", "18")
    assert not same_number("18", "-18")
    assert not same_number("eighteen", "18")


def test_pathological_inputs_are_linear() -> None:
    braces = "\\boxed{" + "{" * 50_000 + "}" * 50_000  # 100 KB, one brace short of closing the box
    tags = "<answer>" * 20_000 + "</think>" * 20_000
    start = time.thread_time()  # this thread's CPU time: what the scans cost, whatever else the machine runs
    assert last_boxed(braces) is None
    assert not r1_formatted(tags)
    assert answer_tag(tags) is None
    assert last_number("9" * 100_000) == "9" * 100_000
    # Linear scans take about 15 ms of CPU; a backtracking regex would take minutes. 5 CPU s tells them apart on any
    # CPU, and no other process or thread is counted.
    assert time.thread_time() - start < 5.0
