"""Allocators: the paper's GSM8K/MATH layouts, non-dyadic P, refill rounds, validation and resume state."""

from __future__ import annotations

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from gpo import registry
from gpo.errors import UserError

registry.load_builtins()


def allocator(name, **cfg):
    return registry.get("allocator", name).build(cfg)


def pruner(name, **cfg):
    return registry.get("pruner", name).build(cfg)


def run_step(alloc, slots, group_size, kept_per_group, world_size, kept_per_round):
    """Drive one step as the engine does: draw, then ask for another round after every round (the last included).

    `kept_per_round(round_index, questions)` says how many rows that round's filtering and pruning kept.
    Returns the questions drawn per round."""
    drawn = [alloc.first_round(slots, group_size, kept_per_group, world_size)]
    filled = 0
    while True:
        filled += kept_per_round(len(drawn) - 1, drawn[-1])
        more = alloc.next_round(slots - filled, len(drawn), group_size, kept_per_group, world_size)
        if more == 0:
            return drawn
        drawn.append(more)


# --- the paper's layouts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rate, questions",
    [(0.0, 1), (0.5, 2), (0.75, 4), (0.875, 8), (0.9375, 16)],  # CPPO paper (arXiv 2503.22342), GSM8K table (B=1, G=16)
)
def test_gsm8k_layout(rate, questions):
    """G=16, 16 training rows (B=1): questions per step 1/2/4/8/16, and 16 completions kept every time."""
    p = pruner("topk", rate=rate)
    k = p.expected_kept_per_group(16)  # 16 - round(16P): 16, 8, 4, 2, 1
    alloc = allocator("dynamic")
    drawn = run_step(alloc, slots=16, group_size=16, kept_per_group=k, world_size=1,
                     kept_per_round=lambda _, q: int(q * k))
    assert drawn == [questions]  # one round: the first draw already fills the slots
    # the real pruner on a step of that many groups of 16 keeps exactly 16
    n = questions * 16
    batch = _batch(_distinct(n), group_size=16)
    assert int(p.keep(batch).sum()) == 16
    assert alloc.metrics() == {"alloc/rounds": 1.0, "alloc/questions": float(questions),
                               "alloc/slots_filled_frac": 1.0}


def test_math_layout_three_ranks():
    """MATH: 3 training ranks, B=3, P=0.75 -> 12 questions per step, 4 per rank, 48 kept (16 per rank)."""
    k = pruner("topk", rate=0.75).expected_kept_per_group(16)  # 16 - 12 = 4
    assert allocator("dynamic").first_round(slots=48, group_size=16, kept_per_group=k, world_size=3) == 12


@pytest.mark.parametrize(
    "rate, k, questions, reference_group",
    [
        (0.6, 6, 3, 12),  # k = 16 - round(9.6) = 6; ceil(16/6) = 3 questions; reference: int(6.4)*int(2.5) = 12
        (0.8, 3, 6, 15),  # k = 16 - round(12.8) = 3; ceil(16/3) = 6; reference: int(3.2)*int(5.0) = 15
        (0.9, 2, 8, 10),  # k = 16 - round(14.4) = 2; ceil(16/2) = 8; reference: int(1.6)*int(10.0) = 10
    ],
)
def test_non_dyadic_rate_keeps_group_size(rate, k, questions, reference_group):
    p = pruner("topk", rate=rate)
    assert p.expected_kept_per_group(16) == k
    q = allocator("dynamic").first_round(slots=16, group_size=16, kept_per_group=k, world_size=1)
    assert q == questions
    # every question is still generated with G = 16 (not the reference's `reference_group`) and keeps exactly k
    batch = _batch(_distinct(q * 16), group_size=16)
    keep = p.keep(batch)
    assert keep.reshape(q, 16).sum(dim=1).tolist() == [k] * q
    assert q * k >= 16  # the slots are filled (18, 18, 16 rows)
    assert reference_group != 16


def test_questions_rounded_up_to_world_size():
    # slots 24 over 3 ranks, k = 5 (G=8, P=0.375: 8 - round(3.0)): ceil(24/5) = 5 -> 6, a multiple of 3
    k = pruner("topk", rate=0.375).expected_kept_per_group(8)
    assert k == 5
    assert allocator("dynamic").first_round(slots=24, group_size=8, kept_per_group=k, world_size=3) == 6


def test_explicit_rate_replaces_pruner_estimate():
    # rate 0.5 with G=16 -> k = 8 -> ceil(16/8) = 2, whatever the pruner said (4 here)
    assert allocator("dynamic", rate=0.5).first_round(16, 16, 4.0, 1) == 2


def test_selector_pass_rate_scales_the_draw_with_or_without_a_rate():
    # k = 2 kept per whole group, a quarter of the candidates expected to reach one: ceil(16 / (2 * 0.25)) = 32
    assert allocator("dynamic").first_round(16, 8, 2.0, 1, pass_rate=0.25) == 32
    # rate 0.75 -> k = 8 - 6 = 2 replaces the pruner's 4; the selector's share still applies (it used to be lost)
    assert allocator("dynamic", rate=0.75).first_round(16, 8, 4.0, 1, pass_rate=0.25) == 32
    alloc = allocator("dynamic", rate=0.75)
    alloc.first_round(16, 8, None, 1, pass_rate=0.5)
    assert alloc.next_round(6, 1, 8, None, 1, pass_rate=0.5) == 6  # ceil(6 / (2 * 0.5))
    assert allocator("static").first_round(16, 8, 2.0, 1, pass_rate=0.25) == 2  # static draws B regardless
    with pytest.raises(UserError, match=r"the selector expects a pass rate of 0.0"):
        allocator("dynamic").first_round(16, 8, 2.0, 1, pass_rate=0.0)


def test_asked_again_after_a_zero_the_dynamic_allocator_refills_from_the_exact_fill():
    """While a round's second phase is generating, the engine asks with slots_left estimated (here: the estimate
    says full, so 0); once its rows are known it asks again with the same rounds_done and gets a refill."""
    alloc = allocator("dynamic")
    assert alloc.first_round(16, 8, 2.0, 1) == 8
    assert alloc.next_round(0, 1, 8, 2.0, 1) == 0  # estimated: the waiting round fills the step
    assert alloc.next_round(4, 1, 8, 2.0, 1) == 2  # exact: 4 rows short -> ceil(4/2)
    assert alloc.next_round(-2, 2, 8, 2.0, 1) == 0
    assert alloc.metrics() == {"alloc/rounds": 2.0, "alloc/questions": 10.0, "alloc/slots_filled_frac": 1.0}
    assert alloc.state_dict() == {"seen_kept": 18, "seen_questions": 10}  # the final fill, folded in once
    assert alloc.state_dict() == {"seen_kept": 18, "seen_questions": 10}


# --- refills -------------------------------------------------------------------------------------------------------


def test_refill_after_group_filtering():
    """slots 16, G=8, k=2, two ranks: 8 questions; DAPO drops 3 groups, so 10 kept; refill ceil(6/2)=3 -> 4."""
    alloc = allocator("dynamic")
    drawn = run_step(alloc, 16, 8, 2.0, 2, kept_per_round=lambda r, q: 10 if r == 0 else 2 * q)
    assert drawn == [8, 4]  # round 2 keeps 8 more: 18 >= 16
    assert alloc.metrics() == {"alloc/rounds": 2.0, "alloc/questions": 12.0, "alloc/slots_filled_frac": 1.0}


def test_refill_stops_at_max_rounds():
    alloc = allocator("dynamic", max_rounds=1)
    drawn = run_step(alloc, 16, 8, 2.0, 1, kept_per_round=lambda r, q: 10)
    assert drawn == [8]
    assert alloc.metrics()["alloc/slots_filled_frac"] == 10 / 16


def test_no_estimate_starts_with_b_and_learns_the_yield():
    """threshold pruner: no estimate, no rate. slots 16, G=8 -> B = 2 questions first."""
    alloc = allocator("dynamic")
    # round 1 keeps 4 of 16 generated: 2 per question, so the refill asks ceil(12/2) = 6 questions, which keep 12
    drawn = run_step(alloc, 16, 8, None, 1, kept_per_round=lambda r, q: 2 * q)
    assert drawn == [2, 6]
    # next step: 16 kept from 8 questions so far -> 2 per question -> ceil(16/2) = 8 questions up front
    assert alloc.first_round(16, 8, None, 1) == 8
    assert allocator("dynamic", adapt=False).first_round(16, 8, None, 1) == 2


def test_no_estimate_and_nothing_kept_redraws_full_groups():
    alloc = allocator("dynamic")
    drawn = run_step(alloc, 16, 8, None, 1, kept_per_round=lambda r, q: 0)
    assert drawn == [2, 2, 2]  # nothing learned: ceil(16/8) each round until max_rounds=3
    assert alloc.metrics()["alloc/slots_filled_frac"] == 0.0


def test_state_survives_resume():
    alloc = allocator("dynamic")
    run_step(alloc, 16, 8, None, 1, kept_per_round=lambda r, q: 2 * q)  # 16 kept from 8 questions
    state = alloc.state_dict()
    assert state == {"seen_kept": 16, "seen_questions": 8}
    resumed = allocator("dynamic")
    resumed.load_state_dict(state)
    assert resumed.first_round(16, 8, None, 1) == alloc.first_round(16, 8, None, 1) == 8


def test_static_allocator_refills_and_reports():
    alloc = allocator("static", max_rounds=2)
    drawn = run_step(alloc, 32, 8, None, 2, kept_per_round=lambda r, q: 24 if r == 0 else 8 * q)
    assert drawn == [4, 2]  # 32/8 = 4; 8 slots left -> 1 question -> 2 (two ranks)
    assert alloc.metrics() == {"alloc/rounds": 2.0, "alloc/questions": 6.0, "alloc/slots_filled_frac": 1.0}


# --- validation ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, cfg, call, fragment",
    [
        ("dynamic", {}, (16, 8, 2.0, 3), "split evenly over 3 ranks"),
        ("dynamic", {}, (16, 8, 0.0, 1), "must be in (0, 8]"),
        ("dynamic", {}, (16, 8, 9.0, 1), "must be in (0, 8]"),
        ("dynamic", {}, (0, 8, 2.0, 1), "must all be >= 1"),
        ("static", {}, (12, 8, None, 1), "not a whole number of groups"),
        ("static", {}, (16, 8, None, 4), "split evenly"),
    ],
)
def test_bad_layouts_are_user_errors(name, cfg, call, fragment):
    with pytest.raises(UserError) as err:
        allocator(name, **cfg).first_round(*call)
    assert fragment in str(err.value)


def test_bad_config_fails_in_constructor():
    # A mapping is checked as the composer checks a section (registry.Entry.build): the fields' types say it.
    with pytest.raises(UserError, match="max_rounds"):
        allocator("dynamic", max_rounds=0)
    with pytest.raises(UserError, match="allocator.rate"):
        allocator("dynamic", rate=1.0)
    with pytest.raises(UserError, match="max_rounds"):
        allocator("static", max_rounds=0)


@pytest.mark.parametrize(
    "name, fields, field",
    [
        ("dynamic", {"rate": 1.0}, "rate"),  # P = 1 keeps nothing to fill the slots with
        ("dynamic", {"rate": -0.1}, "rate"),
        ("dynamic", {"max_rounds": 0}, "max_rounds"),
        ("static", {"max_rounds": 0}, "max_rounds"),
    ],
)
def test_config_types_reject_out_of_range_values(name, fields, field):
    with pytest.raises(ValidationError) as err:
        TypeAdapter(registry.get("allocator", name).config).validate_python(fields)
    assert err.value.errors()[0]["loc"][0] == field


def test_no_allocator_imports_a_pruner():
    """The dynamic allocator shares k's rounding with the pruners through gpo.quota, not through a pruner."""
    import ast
    import pathlib

    for path in pathlib.Path(__file__).parents[2].joinpath("allocators").glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.startswith("gpo.pruners")], path.name


def _distinct(n):
    """n advantages of alternating sign and distinct magnitudes (0.5, -1.0, 1.5, ...): top-k has no ties to break,
    so the exact counts hold without depending on a random draw."""
    return torch.arange(1, n + 1, dtype=torch.float32) * 0.5 * torch.tensor([1.0, -1.0]).repeat((n + 1) // 2)[:n]


def _batch(advantages, group_size):
    from kit import make_batch

    return make_batch(advantages.tolist(), group_size)
