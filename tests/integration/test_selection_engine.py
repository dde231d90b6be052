"""Selectors inside the engine, on a tiny random model and a task whose groups are foreseeable (tests/plugins/
gpo_thirds.py: question i is always right, always wrong or mixed by i % 3): what screening generates and trains
on, the dynamic allocator's accounting of what selection removes, and every selector with every allocator."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from gpo import registry
from gpo.config import compose
from gpo.engine import Engine

sys.path.insert(0, str(Path(__file__).parents[1] / "plugins"))

THIRDS = [
    "tracker=none", "task=thirds", "plugins=[gpo_thirds]", "task.size=12",
    "train.questions_per_step=2", "train.group_size=4", "train.max_completion_length=8",
    "train.micro_batch_size=4", "optim.lr=1e-2", "optim.warmup_ratio=0", "eval.before_and_after=false",
]


def engine(tiny_model_path: str, tmp_path: Path, *extra: str) -> Engine:
    return Engine(compose([f"model={tiny_model_path}", f"output_dir={tmp_path}", *THIRDS, *extra]))


class Drawn:
    """Records the pool indices each round drew (wrapping QuestionStream.take_indices)."""

    def __init__(self, e: Engine) -> None:
        self.rounds: list[list[int]] = []
        original = e.questions.take_indices

        def recorded(n: int) -> list[int]:
            out = original(n)
            self.rounds.append(out)
            return out

        e.questions.take_indices = recorded


def test_screen_trains_only_on_questions_whose_screening_rewards_differ(tiny_model_path, tmp_path):
    e = engine(tiny_model_path, tmp_path, "selector=screen", "selector.n_screen=2", "pruner=none",
               "allocator=static", "allocator.max_rounds=1", "train.questions_per_step=12")
    drawn = Drawn(e)
    trained = []
    original = e._fill_logprobs
    e._fill_logprobs = lambda kept: (trained.append(kept), original(kept))[1]
    m = e.step()
    (questions,) = drawn.rounds
    foreseeable = [q for q in questions if q % 3 != 2]  # always right or always wrong: screened out after 2
    assert sorted(questions) == list(range(12))  # the whole pool, 8 of its questions foreseeable
    assert m["select/considered"] == 12 and m["select/screened"] == 12 and m["select/skipped"] == 0
    assert m["select/screened_out"] >= len(foreseeable) == 8
    continued = int(12 - m["select/screened_out"])
    assert continued > 0, "no mixed question survived screening: the test shows nothing"
    # Screening rows count among the G: 2 per candidate, then 2 more for each continued one.
    assert m["select/completions"] == 12 * 2 + continued * 2
    assert m["select/completions_baseline"] == 48
    assert m["select/zero_var_after"] == 0.0  # every whole group had differing screening rewards
    (kept,) = trained
    assert len(kept) == continued * 4 and (kept.rewards.view(-1, 4).std(dim=1) > 0).all()
    assert m["tokens/generated"] > float(kept.lengths.sum())  # screened-out rows were generated, not trained
    assert m["tokens/generated_per_useful_row"] == pytest.approx(m["tokens/generated"] / continued / 4)


def test_dynamic_allocator_draws_for_the_screen_pass_rate_it_has_seen(tiny_model_path, tmp_path):
    e = engine(tiny_model_path, tmp_path, "selector=screen", "selector.n_screen=2", "pruner=topk",
               "pruner.rate=0.5", "allocator=dynamic", "allocator.max_rounds=4")
    first = e.step()
    # Step 1 has no estimate: ceil(8 slots / 2 kept) = 4 candidates, then refills while slots stay empty.
    assert e.rollout.selector.screened > 0
    fraction = e.rollout.selector.expected_pass_rate()
    second = e.step()
    drawn_first_round = math.ceil(8 / (2 * fraction))
    assert second["select/considered"] >= drawn_first_round
    assert second["alloc/rounds"] <= 4 and first["alloc/rounds"] <= 4
    assert e.rollout.allocator.step.questions == second["select/considered"]


def test_selector_none_is_plain_grpo_generation(tiny_model_path, tmp_path):
    e = engine(tiny_model_path, tmp_path, "selector=none", "pruner=none", "allocator=static")
    m = e.step()
    assert m["select/completions"] == m["select/completions_baseline"] == 8
    assert m["select/skipped"] == m["select/screened"] == 0 and m["select/tokens_saved_est"] == 0


@pytest.mark.parametrize("selector", ["screen", "greso", "mopps"])
@pytest.mark.parametrize("algo,pruner,allocator", [("dapo", "topk", "dynamic"), ("grpo", "threshold", "static")])
def test_every_selector_composes_with_algos_pruners_allocators(selector, algo, pruner, allocator, tiny_model_path,
                                                               tmp_path):
    registry.load_builtins()
    e = engine(tiny_model_path, tmp_path, f"selector={selector}", f"algo={algo}", f"pruner={pruner}",
               f"allocator={allocator}", "selector.n_screen=2" if selector == "screen" else "seed=1",
               "train.steps=3")
    for _ in range(3):  # 3 steps over a 12-question pool: questions come back, histories matter
        m = e.step()
        assert m["select/considered"] >= 2
        assert m["select/completions"] <= m["select/completions_baseline"]
        assert ("train/rows" in m) != (m.get("train/skipped") == 1.0)  # it trained, or said it had nothing to
        assert all(isinstance(v, float) and not math.isinf(v) for k, v in m.items() if k.startswith("select/"))
    state = e.rollout.selector.state_dict()
    assert state == e.rollout.selector.state_dict() and torch.isfinite(torch.tensor(m["select/completions_frac"]))


def test_dapo_dynamic_sampling_finds_zero_variance_groups_after_n_screen_rollouts(tiny_model_path, tmp_path):
    runs = {}
    for selector in ("none", "screen"):
        e = engine(tiny_model_path, tmp_path / selector, f"selector={selector}", "selector.n_screen=2" if selector
                   == "screen" else "seed=42", "algo=dapo", "pruner=none", "allocator=static",
                   "allocator.max_rounds=1", "train.questions_per_step=12")
        runs[selector] = e.step()
    plain, screened = runs["none"], runs["screen"]
    # Without screening DAPO generates all 12 x 4 and then drops the (at least 8) foreseeable groups; with it those
    # cost 2 rollouts each and every whole group that reaches DAPO has signal, so its filter drops none.
    assert plain["select/completions"] == 48 and plain["filter/kept_groups_frac"] <= 4 / 12
    assert screened["select/completions"] <= 12 * 2 + 4 * 2
    assert screened["filter/kept_groups_frac"] == 1.0


class Calls:
    """Records the completion count(s) of every backend call (an int, or a list from a per-prompt-count call)."""

    def __init__(self, e: Engine) -> None:
        self.n: list[int | list[int]] = []
        original = e.backend.generate

        def recorded(prompts, n, sampling, seed):
            self.n.append(n if isinstance(n, int) else list(n))
            return original(prompts, n, sampling, seed)

        e.backend.generate = recorded


@pytest.mark.parametrize("per_prompt_counts", [True, False])
def test_a_rounds_continuation_and_the_next_rounds_screening_share_a_call(per_prompt_counts, tiny_model_path,
                                                                          tmp_path):
    """G = 6, 12 slots, screening with 2 and only each round's first candidate continued (test selector). Round 1
    screens 2 candidates and continues 1, so 6 slots stay empty by the estimate: round 2 (1 candidate) is drawn at
    once and its screening (2 rows) goes in the same call as round 1's continuation (4 rows). Round 2's
    continuation fills the step alone. 3 calls, where generating the phases one by one takes 4; a backend with one
    count per call still shares nothing but equal counts."""
    e = engine(tiny_model_path, tmp_path, "selector=first_of_round", "train.group_size=6", "pruner=none",
               "allocator=static", "allocator.max_rounds=4")
    if not per_prompt_counts:
        e.backend.cfg = type(e.backend.cfg)(decode="generate")  # transformers' loop: one n per call
    calls, drawn = Calls(e), Drawn(e)
    m = e.step()
    assert [len(r) for r in drawn.rounds] == [2, 1]
    if per_prompt_counts:
        assert calls.n == [2, [4, 2], 4]
    else:
        assert calls.n == [2, 2, 4, 4]
    assert m["select/generation_calls"] == len(calls.n)
    assert m["select/considered"] == 3 and m["select/screened_out"] == 1
    assert m["select/completions"] == 3 * 2 + 2 * 4
    assert m["train/rows"] == 12 and m["alloc/slots_filled_frac"] == 1.0 and m["alloc/rounds"] == 2


def test_rounds_are_drawn_while_the_waiting_rounds_estimate_leaves_slots_empty(tiny_model_path, tmp_path):
    """topk keeps 2 of 4 per whole group. While the waiting round's continued groups (counted by that estimate)
    leave slots empty, the dynamic allocator draws the next round at once, up to max_rounds; the last round's
    continuation is generated alone and the allocator, asked again with the exact fill, stops at max_rounds."""
    e = engine(tiny_model_path, tmp_path, "selector=first_of_round", "pruner=topk", "pruner.rate=0.5",
               "allocator=dynamic", "allocator.max_rounds=3")
    drawn = Drawn(e)
    m = e.step()
    # 8 slots, k = 2: 4 candidates; 1 continued -> 6 short by the estimate -> 3 more; 1 continued -> 4 short -> 2
    assert [len(r) for r in drawn.rounds] == [4, 3, 2]
    assert m["alloc/rounds"] == 3 and m["select/considered"] == 9
    assert m["train/rows"] == 3 * 2  # one continued group per round, 2 rows kept of each
    assert m["select/generation_calls"] == 4  # screen 1; cont 1 + screen 2; cont 2 + screen 3; cont 3


def test_a_rank_with_no_share_of_a_uniform_call_still_passes_one_count(tiny_model_path, tmp_path):
    """One prompt over two ranks leaves rank 0 nothing to generate: its backend is still asked with the call's
    single count, never a list (a backend without per_prompt_counts takes an int only)."""
    from gpo.metrics import PhaseTimer
    from gpo.rollout_phases import Call

    e = engine(tiny_model_path, tmp_path, "selector=none")
    e.rollout.world_size = 2  # rank 0 of 2: rank_share(1, 0, 2) is empty (the gather is the identity in one process)
    calls = Calls(e)
    batch = e.rollout.generate([e.questions.examples[0]], Call(entries=[(0, 0)], counts=[4], seed=3), PhaseTimer(),
                               {})
    assert calls.n == [4] and len(batch) == 0
