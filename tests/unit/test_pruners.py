"""Pruners: hand-built advantages for each rule, exact counts, seeded tie-breaks, top-ups to a multiple of the
world size, typed configs, and invariants (hypothesis)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from gpo import registry
from gpo.errors import UserError
from gpo.metrics import prune_metrics
from gpo.pruners.ranking import row_keys, top_up
from gpo.quota import kept_per_group
from kit import make_batch

registry.load_builtins()


def build(name, **cfg):
    return registry.get("pruner", name).build(cfg)


def kept_rows(keep):
    return keep.nonzero(as_tuple=True)[0].tolist()


# --- k from the config -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "group_size, rate, expected",
    [
        (8, 0.75, 2),  # 8 - round(6.0) = 2
        (16, 0.875, 2),  # 16 - round(14.0) = 2
        (16, 0.9375, 1),  # 16 - round(15.0) = 1
        (16, 0.6, 6),  # 16 - round(9.6) = 16 - 10 = 6 (the reference's int() gave 6 too, but groups of 12)
        (16, 0.8, 3),  # 16 - round(12.8) = 3
        (16, 0.9, 2),  # 16 - round(14.4) = 2
        (4, 0.625, 1),  # 4 - round(2.5) = 4 - 3 = 1: halves round up, not to even
        (16, 0.0, 16),  # P = 0 is GRPO
        (50, 0.29, 35),  # 50 - round(14.5) = 35; in binary floating point 50 * 0.29 = 14.4999... gave 36
        (100, 0.145, 85),  # 100 - round(14.5) = 85
        (25, 0.58, 10),  # 25 - round(14.5) = 10
    ],
)
def test_kept_per_group_from_rate(group_size, rate, expected):
    assert kept_per_group(group_size, rate=rate) == expected


def test_kept_per_group_matches_the_documented_rule_on_the_whole_grid():
    """Every G <= 128 and every P = m/1000: k = G - round(G*m/1000), halves up, in integer arithmetic only."""
    for group_size in range(1, 129):
        for m in range(1000):
            rate = float(f"0.{m:03d}")  # the rate as a user writes it
            pruned = (2 * group_size * m + 1000) // 2000  # floor(G*m/1000 + 1/2), exact
            expected = group_size - pruned
            if expected >= 1:
                assert kept_per_group(group_size, rate=rate) == expected, (group_size, rate)
            else:
                with pytest.raises(UserError, match="keeps 0 of a group"):
                    kept_per_group(group_size, rate=rate)


def test_dynamic_allocator_shares_the_exact_k():
    registry.load_builtins()
    entry = registry.get("allocator", "dynamic")
    allocator = entry.build(entry.config(rate=0.29))
    # k = 35 of G = 50: 35 groups' worth of slots (1750) need ceil(1750 / 35) = 50 questions; the float rule's
    # k = 36 drew ceil(1750 / 36) = 49.
    assert allocator.first_round(slots=35 * 50, group_size=50, kept_per_group=None, world_size=1) == 50


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(group_size=10, rate=0.95), "keeps 0 of a group of 10"),  # 10 - round(9.5) = 0: never truncated to 0
        # Rates outside [0, 1) never come from a config (its `Rate` annotation refuses them) but still fail here:
        (dict(group_size=8, rate=1.0), "keeps 0 of a group of 8"),  # 8 - round(8.0) = 0
        (dict(group_size=8, rate=-0.1), "keeps 9 of a group of 8"),  # 8 - round(-0.8) = 8 - (-1) = 9
        (dict(group_size=4, keep=5), "keep=5 keeps 5 of a group of 4"),
        (dict(group_size=4, keep=0), "between 1 and 4"),
    ],
)
def test_kept_per_group_rejects_impossible_k(kwargs, fragment):
    with pytest.raises(UserError, match=None) as err:
        kept_per_group(**kwargs)
    assert fragment in str(err.value)


def test_constructor_validates():
    # A mapping is checked as the composer checks a section (registry.Entry.build): the fields' types say it.
    with pytest.raises(UserError, match="pruner.scope"):
        build("topk", scope="per_question")
    with pytest.raises(UserError, match="pruner.keep"):
        build("random", keep=0)
    with pytest.raises(UserError, match="pruner.rate"):
        build("topk", rate=1.0)
    with pytest.raises(UserError, match="pruner.gamma"):
        build("threshold", gamma=-1.0)
    with pytest.raises(UserError, match="pruner.min_keep_per_group"):
        build("threshold", min_keep_per_group=-1)
    with pytest.raises(UserError, match="set either"):
        build("random", rate=None)  # neither rate nor keep: a check of two fields, the constructor's


def validated(name, **fields):
    """The pruner's config as the composer makes it: pydantic checks every field against its annotation."""
    return TypeAdapter(registry.get("pruner", name).config).validate_python(fields)


@pytest.mark.parametrize(
    "name, fields, field",
    [
        ("topk", {"rate": 1.0}, "rate"),  # P = 1 would prune every completion
        ("topk", {"rate": -0.1}, "rate"),
        ("random", {"rate": 1.0}, "rate"),
        ("random", {"rate": -0.1}, "rate"),
        ("topk", {"scope": "per_question"}, "scope"),
        ("random", {"scope": "per_question"}, "scope"),
        ("random", {"keep": 0}, "keep"),
        ("topk", {"seed": 2**63}, "seed"),  # row_keys packs the seed into 8 signed bytes
        ("threshold", {"gamma": -1.0}, "gamma"),
        ("threshold", {"min_keep_per_group": -1}, "min_keep_per_group"),
    ],
)
def test_config_types_reject_out_of_range_values(name, fields, field):
    with pytest.raises(ValidationError) as err:
        validated(name, **fields)
    assert err.value.errors()[0]["loc"][0] == field


def test_config_types_accept_the_documented_choices():
    assert [validated("topk", scope=s).scope for s in ("group", "rank", "global")] == ["group", "rank", "global"]
    assert validated("random", rate=0.0, keep=3) == registry.get("pruner", "random").config(rate=0.0, keep=3)
    assert validated("threshold", gamma=0.0).gamma == 0.0


BUILTIN_PRUNERS = [e for e in registry.entries("pruner") if e.cls.__module__.startswith("gpo.pruners.")]


@pytest.mark.parametrize("entry", BUILTIN_PRUNERS, ids=lambda e: e.name)
def test_pruner_configs_are_frozen_and_their_defaults_validate(entry):
    assert entry.config.__dataclass_params__.frozen
    assert TypeAdapter(entry.config).validate_python({}) == entry.config()
    fields = dataclasses.fields(entry.config)
    if fields:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(entry.config(), fields[0].name, None)


def test_random_registers_its_own_config():
    assert registry.get("pruner", "random").config is not registry.get("pruner", "topk").config


def test_keep_larger_than_group_fails_on_the_batch():
    with pytest.raises(UserError, match="keeps 3 of a group of 2"):
        build("topk", keep=3).keep(make_batch([1.0, 0.0], group_size=2))


def test_expected_kept_per_group():
    assert build("topk", rate=0.75).expected_kept_per_group(8) == 2.0
    assert build("topk", keep=3, rate=0.75).expected_kept_per_group(8) == 3.0  # keep replaces rate
    assert build("random", rate=0.5).expected_kept_per_group(16) == 8.0
    assert build("threshold", gamma=0.5).expected_kept_per_group(8) is None
    assert build("threshold", gamma=0.0).expected_kept_per_group(8) == 8.0
    assert build("none").expected_kept_per_group(8) == 8.0


# --- topk: the three scopes on hand-built advantages --------------------------------------------------------------

# Two questions of G=4. Group 0: |A| = 3, 2, 1, 0.5 (all distinct). Group 1: |A| = 0, 0, 0.2, 0.
SCOPES_ADV = [3.0, -2.0, 1.0, -0.5, 0.0, 0.0, -0.2, 0.0]


def test_topk_group_scope_keeps_k_largest_per_question():
    keep = build("topk", keep=2, scope="group").keep(make_batch(SCOPES_ADV, group_size=4))
    # group 0: |A| 3 and 2 (rows 0, 1); group 1: 0.2 (row 6) plus one of the three tied zeros (rows 4, 5, 7)
    rows = kept_rows(keep)
    assert rows[:2] == [0, 1] and 6 in rows and len(rows) == 4
    assert len({4, 5, 7} & set(rows)) == 1


def test_topk_global_scope_ranks_across_questions():
    keep = build("topk", keep=2, scope="global").keep(make_batch(SCOPES_ADV, group_size=4))
    # quota 2 x 2 questions = 4; the four largest |A| are 3, 2, 1, 0.5, all in group 0: group 1 loses every row
    assert kept_rows(keep) == [0, 1, 2, 3]


def test_topk_rank_scope_ranks_within_each_owner():
    # rank 0 owns groups 0 and 1 (rows 0-7), rank 1 owns group 2 (rows 8-11)
    adv = SCOPES_ADV + [0.1, 0.4, -0.3, 0.2]
    owner = [0] * 8 + [1] * 4
    keep = build("topk", keep=2, scope="rank").keep(make_batch(adv, group_size=4, owner_rank=owner))
    # rank 0: quota 2 x 2 = 4 -> rows 0-3 as in global scope; rank 1: quota 2 -> |A| 0.4 and 0.3 (rows 9, 10)
    assert kept_rows(keep) == [0, 1, 2, 3, 9, 10]


def test_topk_rate_gives_integer_k():
    # G=8, P=0.75 -> k = 2 per group; |A| distinct, so rows with |A| 8 and 7 (rows 1, 6) and 0.9, 0.8 (rows 8, 15)
    adv = [1, 8, 2, 3, 4, 5, 7, 6] + [0.9, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8]
    keep = build("topk", rate=0.75).keep(make_batch(adv, group_size=8))
    assert kept_rows(keep) == [1, 6, 8, 15]


def test_zero_advantage_rows_are_pruned_first():
    # every row of a zero-variance group has A = 0 exactly; the global quota is 1 x 3 questions = 3, and six rows
    # tie at |A| = 0.1: the zeros all go, and three of the six 0.1s stay (chosen by the seeded key)
    adv = [0.0, 0.0, 0.0] + [0.1, -0.1, 0.1] + [0.1, 0.1, -0.1]
    keep = build("topk", keep=1, scope="global").keep(make_batch(adv, group_size=3))
    assert not keep[:3].any() and int(keep[3:].sum()) == 3


# --- ties: seeded, content-derived key -------------------------------------------------------------------------


def test_ties_break_by_seeded_key_not_by_position():
    batch = make_batch([0.5] * 4, group_size=4)
    keys = row_keys(batch, seed=0)
    keep = build("topk", keep=1, seed=0).keep(batch)
    assert kept_rows(keep) == [int(keys.argmin())]  # among equal |A| the smallest key wins


def test_tie_break_is_deterministic_and_depends_on_seed():
    batch = make_batch([1.0] * 64, group_size=4)  # 16 groups of four tied rows
    first = build("topk", keep=1, seed=0).keep(batch)
    assert torch.equal(first, build("topk", keep=1, seed=0).keep(batch))
    # another seed re-draws: the chance that 16 independent 1-of-4 draws all agree is 4**-16
    assert not torch.equal(first, build("topk", keep=1, seed=1).keep(batch))


def test_row_keys_ignore_padding_and_position_but_not_content():
    batch = make_batch([0.0] * 4, group_size=2)
    padded = make_batch([0.0] * 4, group_size=2, pad=3)
    assert torch.equal(row_keys(batch, 5), row_keys(padded, 5))
    reversed_rows = batch.select(torch.tensor([3, 2, 1, 0]))
    assert torch.equal(row_keys(reversed_rows, 5), row_keys(batch, 5).flip(0))
    other = make_batch([0.0] * 4, group_size=2, tokens=[100, 101, 102, 999])  # next step: new completions
    assert torch.equal(row_keys(other, 5)[:3], row_keys(batch, 5)[:3])
    assert row_keys(other, 5)[3] != row_keys(batch, 5)[3]


# --- threshold and random ----------------------------------------------------------------------------------------

THRESHOLD_ADV = [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]  # rewards [1,0,0,0]: (r-0.25)/0.5; then a flat group


def test_threshold_drops_below_gamma():
    batch = make_batch(THRESHOLD_ADV, group_size=4)
    assert kept_rows(build("threshold", gamma=0.5).keep(batch)) == [0, 1, 2, 3]  # 0.5 >= 0.5 is kept
    assert kept_rows(build("threshold", gamma=0.6).keep(batch)) == [0]
    assert kept_rows(build("threshold", gamma=0.0).keep(batch)) == list(range(8))


def test_threshold_floor_keeps_largest_rows_per_group():
    batch = make_batch(THRESHOLD_ADV, group_size=4)
    rows = kept_rows(build("threshold", gamma=0.6, min_keep_per_group=2).keep(batch))
    # group 0: row 0 (above gamma) + the largest of the tied 0.5s; group 1: two of the four zeros
    assert rows[0] == 0 and len(rows) == 4
    assert len(set(rows) & {1, 2, 3}) == 1 and len(set(rows) & {4, 5, 6, 7}) == 2
    with pytest.raises(UserError, match="exceeds the group size 4"):
        build("threshold", gamma=0.6, min_keep_per_group=5).keep(batch)


def test_random_keeps_topk_counts_but_ignores_advantage():
    adv = [float(i % 8) for i in range(64)]  # 8 groups of 8 with |A| 0..7
    batch = make_batch(adv, group_size=8)
    keep = build("random", keep=2, seed=3).keep(batch)
    assert keep.reshape(8, 8).sum(dim=1).tolist() == [2] * 8
    assert torch.equal(keep, build("random", keep=2, seed=3).keep(batch))
    # top-k would keep exactly the |A| = 7, 6 rows of every group; a uniform draw of 8 pairs does not
    assert not torch.equal(keep, build("topk", keep=2).keep(batch))


# --- top-up to a multiple of the world size: by the pruner's own score ----------------------------------------


def test_top_up_adds_the_highest_priority_rows_left_out():
    keep = torch.tensor([True, False, False, True, False])
    priority = torch.tensor([0.0, 0.5, 0.9, 0.0, 0.5])
    assert top_up(keep, priority, 1) is keep and top_up(keep, priority, 2) is keep  # 2 kept: nothing to add
    assert kept_rows(top_up(keep, priority, 3)) == [0, 2, 3]  # one more: the 0.9
    assert kept_rows(top_up(keep, priority, 4)) == [0, 1, 2, 3]  # two more: 0.9, then the first of the tied 0.5s
    assert kept_rows(top_up(torch.tensor([True, True, True, False, False]), priority, 2)) == [0, 1, 2, 4]  # 0.5 > 0
    # 5 rows cannot make 6 (N itself is not a multiple of 2): every row is kept, the count stays uneven
    everything = torch.ones(5, dtype=torch.bool)
    assert top_up(everything, priority, 2) is everything
    assert kept_rows(top_up(torch.tensor([True, True, True, True, False]), priority, 3)) == [0, 1, 2, 3, 4]
    with pytest.raises(UserError, match="multiple_of"):
        top_up(keep, priority, 0)


def test_random_tops_up_by_its_own_priorities_not_by_abs_advantage():
    # One group of 8, |A| rising to 8.0 at row 7. Random keeps 1 row (the smallest key); 3 ranks need 2 more.
    adv = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 8.0]
    batch = make_batch(adv, group_size=8)
    pruner = build("random", keep=1, seed=3)
    by_key = torch.argsort(row_keys(batch, 3)).tolist()  # rows from the smallest key: the random order
    assert kept_rows(pruner.keep(batch)) == [by_key[0]]
    topped = pruner.keep(batch, multiple_of=3)
    assert kept_rows(topped) == sorted(by_key[:3])
    # |A| would have added rows 7 and 6; with this seed the random priorities choose other rows
    by_abs_advantage = kept_rows(top_up(pruner.keep(batch), batch.advantages.abs(), 3))
    assert 7 in by_abs_advantage and 6 in by_abs_advantage
    assert kept_rows(topped) != by_abs_advantage


def test_topk_and_threshold_top_up_by_abs_advantage():
    batch = make_batch([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.9, 1.0, -1.0, 1.0, -1.0], group_size=4)
    # threshold 0.95 keeps |A| 1.5, 1, 1, 1, 1 (rows 0, 8-11): 5 rows; 2 ranks add the 0.9 (row 7)
    assert kept_rows(build("threshold", gamma=0.95).keep(batch, multiple_of=2)) == [0, 7, 8, 9, 10, 11]
    # topk keep=1 keeps rows 0, 7, 8 (group 2: the tied 1s go by key); 2 ranks add the best |A| left: a 1.0
    base = build("topk", keep=1).keep(batch)
    topped = build("topk", keep=1).keep(batch, multiple_of=2)
    added = kept_rows(topped & ~base)
    assert len(added) == 1 and batch.advantages[added[0]].abs() == 1.0


def test_none_pads_nothing():
    batch = make_batch([0.0] * 6, group_size=3)
    for world_size in (1, 2, 4):  # 6 rows over 4 ranks stay 6: none leaves nothing out to add
        assert build("none").keep(batch, multiple_of=world_size).all()


SCOPE_CASES = [(name, scope) for name in ("topk", "random") for scope in ("group", "rank", "global")]


@pytest.mark.parametrize("name, scope", SCOPE_CASES + [("threshold", None), ("none", None)])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_keep_is_divisible_by_the_world_size_for_every_pruner_and_scope(name, scope, world_size):
    # 12 rows: 3 questions of 4, owned by ranks 0, 0, 1; N = 12 splits over 1, 2, 3 and 4 ranks
    adv = [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.9, 1.0, -1.0, 0.2, -0.7]
    batch = make_batch(adv, group_size=4, owner_rank=[0] * 8 + [1] * 4)
    cfg = {"keep": 1, "scope": scope} if scope else ({"gamma": 0.95} if name == "threshold" else {})
    pruner = build(name, **cfg)
    rule, keep = pruner.keep(batch), pruner.keep(batch, multiple_of=world_size)
    assert int(keep.sum()) % world_size == 0
    assert torch.equal(keep & rule, rule) and int((keep & ~rule).sum()) < world_size  # only adds, and no more
    assert torch.equal(pruner.keep(batch, multiple_of=1), rule)


# --- metrics -----------------------------------------------------------------------------------------------------


def test_prune_metrics_hand_computed():
    batch = make_batch(THRESHOLD_ADV, group_size=4)
    keep = torch.tensor([True, True, False, False, False, False, False, True])
    m = prune_metrics(batch, keep)
    assert m["prune/kept_frac"] == 3 / 8
    assert m["prune/abs_adv_kept"] == pytest.approx((1.5 + 0.5 + 0.0) / 3)
    assert m["prune/abs_adv_pruned"] == pytest.approx((0.5 + 0.5 + 0 + 0 + 0) / 5)  # rows 2-6
    assert (m["prune/kept_per_group_min"], m["prune/kept_per_group_mean"], m["prune/kept_per_group_max"]) == (
        1.0, 1.5, 2.0)  # group 0 keeps 2, group 1 keeps 1
    nothing_pruned = prune_metrics(batch, torch.ones(8, dtype=torch.bool))
    assert math.isnan(nothing_pruned["prune/abs_adv_pruned"])


# --- properties ----------------------------------------------------------------------------------------------


@st.composite
def pruning_case(draw):
    questions = draw(st.integers(1, 5))
    group_size = draw(st.integers(1, 6))
    n = questions * group_size
    adv = draw(st.lists(st.sampled_from([0.0, 0.5, -0.5, 1.0, -2.0, 0.25]), min_size=n, max_size=n))  # many ties
    ranks = draw(st.integers(1, questions))
    # contiguous blocks of questions per rank, as all_gather_batch lays them out
    owner = [min(q * ranks // questions, ranks - 1) for q in range(questions) for _ in range(group_size)]
    k = draw(st.integers(1, group_size))
    scope = draw(st.sampled_from(["group", "rank", "global"]))
    return make_batch(adv, group_size, owner_rank=owner), questions, group_size, k, scope


@settings(max_examples=60, deadline=None)
@given(pruning_case(), st.sampled_from(["topk", "random"]))
def test_counts_exact_and_topk_ranks_by_abs_advantage(case, name):
    batch, questions, group_size, k, scope = case
    keep = build(name, keep=k, scope=scope, seed=1).keep(batch)
    assert keep.dtype == torch.bool and keep.shape == (len(batch),)
    segment = {"group": batch.group_ids, "rank": batch.owner_rank, "global": torch.zeros(len(batch))}[scope]
    abs_adv = batch.advantages.abs()
    for s in segment.unique():
        rows = segment == s
        groups_in_segment = len(batch.group_ids[rows].unique())
        assert int(keep[rows].sum()) == k * groups_in_segment
        if name == "topk" and (rows & ~keep).any():
            assert abs_adv[rows & keep].min() >= abs_adv[rows & ~keep].max()  # nothing pruned outranks a kept row
    kept = batch.select(keep)
    assert kept.completion_ids[:, 0].tolist() == batch.completion_ids[keep, 0].tolist()  # a subset, order kept
    assert kept.advantages.tolist() == batch.advantages[keep].tolist()  # advantages untouched


@settings(max_examples=40, deadline=None)
@given(pruning_case(), st.integers(0, 3), st.integers(0, 50))
def test_decision_ignores_padding_and_group_id_offsets(case, pad, first_group):
    """What all_gather_batch changes (widths, group id numbering) must not change a group/global decision."""
    batch, questions, group_size, k, scope = case
    shifted = make_batch(batch.advantages.tolist(), group_size, owner_rank=batch.owner_rank.tolist(), pad=pad,
                         first_group=first_group)
    for name in ("topk", "random"):
        pruner = build(name, keep=k, scope=scope, seed=2)
        assert torch.equal(pruner.keep(batch), pruner.keep(shifted))


def test_config_composer_checks_pruner_fields():
    from gpo.config import compose

    cfg = compose(["pruner=topk", "pruner.rate=0.875", "pruner.scope=global", "allocator=dynamic", "tracker=none"])
    assert (cfg.pruner.rate, cfg.pruner.scope, cfg.allocator.name) == (0.875, "global", "dynamic")
    assert compose(["pruner=threshold", "pruner.gamma=0.5", "tracker=none"]).pruner.gamma == 0.5
    with pytest.raises(UserError, match="pruner.scope"):
        compose(["pruner=topk", "pruner.scope=per_question", "tracker=none"])


@settings(max_examples=60, deadline=None)
@given(pruning_case(), st.sampled_from(["topk", "random", "threshold", "none"]), st.integers(1, 5))
def test_top_up_property(case, name, world_size):
    """Any batch, pruner and world size: the rule's rows stay, fewer than world_size are added, the count is a
    multiple whenever the batch's N is, and no row left out outranks an added one by the pruner's own priority."""
    batch, questions, group_size, k, scope = case
    cfg = {"topk": dict(keep=k, scope=scope, seed=1), "random": dict(keep=k, scope=scope, seed=1),
           "threshold": dict(gamma=0.6, min_keep_per_group=k - 1, seed=1), "none": {}}[name]
    pruner = build(name, **cfg)
    rule, keep = pruner.keep(batch), pruner.keep(batch, multiple_of=world_size)
    added, left_out = keep & ~rule, ~keep
    assert torch.equal(keep & rule, rule) and int(added.sum()) < world_size
    assert int(keep.sum()) % world_size == 0 or (len(batch) % world_size and keep.all())
    priority = -row_keys(batch, 1) if name == "random" else batch.advantages.abs()
    if added.any() and left_out.any():
        assert priority[added].min() >= priority[left_out].max()
