"""Contract tests over EVERY registered component, so a new one is tested the moment it registers.

For each entry: it builds from its default config, `gpo list` has a one-line summary for it, and its config
dataclass survives a trip through the composer (YAML out, compose, dataclass back). Per kind, a small behavioural
contract on synthetic data: pruner.keep -> bool [N], deterministic and pure; algo.advantages keeps [B, G] and
stays finite (also for a zero-variance group); allocator.first_round -> a positive multiple of world_size;
task.prompt -> chat messages (tasks that read benchmark files read GPO_DATA_DIR and skip without it);
selector.first_phase -> a count in [0, G] per candidate, the same for the same state and seed, also after a
state_dict round trip.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gpo import registry
from gpo.config import TrainConfig, compose
from gpo.run_config import as_dict
from gpo.types import QuestionRewards, RolloutBatch
from kit import REPO

DATA = REPO.parent / "shared" / "data"

registry.load_builtins()


def _from_the_test_plugins(entry) -> bool:
    # Test modules of the other tier import tests/plugins/ as they are collected: which of those components are
    # registered here would depend on the collection order, so the set is built-ins and installed plug-ins only.
    module = sys.modules.get(entry.cls.__module__)
    path = getattr(module, "__file__", None)
    return path is not None and Path(path).resolve().is_relative_to(REPO / "tests")


ENTRIES = [e for kind in registry.KINDS for e in registry.entries(kind) if not _from_the_test_plugins(e)]


def _entries(*kinds: str) -> list:
    return [pytest.param(e, id=f"{e.kind}={e.name}") for e in ENTRIES if e.kind in kinds]


def _build(entry, tmp_path):
    """Build with the default config and the context the engine passes to this kind (nothing model-sized)."""
    train = TrainConfig()
    context = {
        "algo": {"max_completion_length": train.max_completion_length},
        "tracker": {"run_dir": str(tmp_path)},
    }.get(entry.kind, {})
    return entry.build(None, **context)


@pytest.mark.parametrize("entry", _entries(*registry.KINDS))
def test_builds_from_its_default_config(entry, tmp_path):
    built = _build(entry, tmp_path)
    assert type(built) is entry.cls
    assert registry.missing_members(entry.kind, built) == []  # the whole interface of its kind
    assert entry.cls.registry_name == entry.name


@pytest.mark.parametrize("entry", _entries(*registry.KINDS))
def test_has_a_one_line_summary(entry):
    summary = entry.summary
    assert summary and summary == summary.strip(), f"{entry.kind} `{entry.name}` needs a docstring summary line"
    assert len(summary) <= 120, f"`gpo list` line too long ({len(summary)} chars): {summary}"


@pytest.mark.parametrize("entry", _entries(*registry.KINDS))
def test_config_round_trips_through_the_composer(entry, tmp_path):
    # Every field written out explicitly (YAML as a user would write it), composed, turned back into the dataclass.
    defaults = entry.config()
    layer = OmegaConf.create({"defaults": {entry.kind: entry.name}, entry.kind: as_dict(defaults)})
    path = tmp_path / "run.yaml"
    path.write_text(OmegaConf.to_yaml(layer))
    cfg = compose([], [path])
    assert getattr(cfg, entry.kind).name == entry.name
    if (entry.kind, entry.name) == ("backend", "hf"):  # its `auto` precision comes back resolved (float32 here)
        defaults = dataclasses.replace(defaults, precision="float32")
    assert getattr(cfg, entry.kind).config == defaults


# --- per kind ------------------------------------------------------------------------------------------------------

B, G = 3, 4
N = B * G


def synthetic_batch() -> RolloutBatch:
    """3 questions x 4 completions with 0/1 rewards: one mixed group, one all-correct, one with a lone correct."""
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])  # [B, G]
    # GRPO advantages by hand, (r - mean) / (std + 1e-4) with the unbiased std:
    #   group 0: mean 0.5, std sqrt(4*0.25/3) = 0.5774 -> +-0.5/0.5775 = +-0.8658
    #   group 1: all equal -> 0
    #   group 2: mean 0.25, std sqrt((3*0.0625 + 0.5625)/3) = 0.5 -> -0.25/0.5001, 0.75/0.5001
    a, c, d = 0.5 / 0.5775, 0.25 / 0.5001, 0.75 / 0.5001
    advantages = torch.tensor([a, -a, a, -a, 0, 0, 0, 0, -c, -c, -c, d])  # [N]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 6, 2, 4, 4, 1, 6, 2, 5, 3, 6])  # [N]
    completion_mask = (torch.arange(6)[None, :] < lengths[:, None]).long()  # [N, L=6]
    return RolloutBatch(
        prompt_ids=torch.randint(5, 100, (N, 3), generator=gen),  # [N, Lp=3]
        prompt_mask=torch.ones(N, 3, dtype=torch.long),  # [N, Lp]
        completion_ids=torch.randint(5, 100, (N, 6), generator=gen) * completion_mask,  # [N, L]
        completion_mask=completion_mask,
        group_ids=torch.arange(B).repeat_interleave(G),  # [N]
        rewards=rewards.flatten(),  # [N]
        advantages=advantages,
        truncated=lengths == 6,  # [N]
        owner_rank=torch.zeros(N, dtype=torch.long),  # [N]
    )


@pytest.mark.parametrize("entry", _entries("pruner"))
def test_pruner_keep_is_a_deterministic_pure_bool_mask(entry, tmp_path):
    pruner = _build(entry, tmp_path)
    batch = synthetic_batch()
    before = batch.advantages.clone()
    first = pruner.keep(batch)
    assert first.dtype == torch.bool and first.shape == (N,)
    assert torch.equal(pruner.keep(synthetic_batch()), first)  # same input, same rows (ties broken by a key)
    assert torch.equal(batch.advantages, before)  # pruning never changes advantages
    kept = pruner.expected_kept_per_group(G)
    assert kept is None or 0 < kept <= G


@pytest.mark.parametrize("entry", _entries("algo"))
def test_algo_advantages_keep_shape_and_stay_finite(entry, tmp_path):
    objective = _build(entry, tmp_path)
    rewards = synthetic_batch().rewards.view(B, G)  # [B, G], group 1 has zero variance
    advantages = objective.advantages(rewards)
    assert advantages.shape == (B, G) and torch.isfinite(advantages).all()
    assert torch.allclose(advantages[1], torch.zeros(G))  # no signal in an all-correct group
    # Within a group a higher reward never gets a lower advantage.
    assert advantages[0, 0] > advantages[0, 1] and advantages[2, 3] > advantages[2, 0]
    group_mask = objective.group_filter(rewards, {"accuracy": rewards})
    assert group_mask.dtype == torch.bool and group_mask.shape == (B,)
    lengths = torch.tensor([[5, 3, 6, 2], [4, 4, 1, 6], [2, 5, 3, 6]])  # [B, G]
    shaped = objective.shape_rewards(rewards, lengths, lengths == 6)
    assert shaped.shape == (B, G) and torch.isfinite(shaped).all()
    assert isinstance(objective.needs_ref_logprobs, bool)
    defaults = entry.config()
    if hasattr(defaults, "beta"):  # a reference model is loaded exactly when the KL term is on
        assert objective.needs_ref_logprobs == (defaults.beta > 0)


@pytest.mark.parametrize("entry", _entries("allocator"))
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("kept_per_group", [None, 2.0, 8.0])
def test_allocator_first_round_is_a_positive_multiple_of_world_size(entry, world_size, kept_per_group, tmp_path):
    allocator = _build(entry, tmp_path)
    questions = allocator.first_round(slots=4 * 8, group_size=8, kept_per_group=kept_per_group, world_size=world_size)
    assert isinstance(questions, int) and questions > 0 and questions % world_size == 0
    assert questions >= 4  # never fewer questions than a GRPO step of B=4 needs


# The test splits of the built-in tasks (arith draws a fixed-size seeded set); other tasks need at least one row.
TEST_ROWS = {"aime24": 30, "amc23": 40, "arith": 500, "gsm8k": 1319, "math": 500}


@pytest.mark.parametrize("entry", _entries("task"))
def test_task_prompt_returns_chat_messages(entry, tmp_path):
    fields = {f.name for f in dataclasses.fields(entry.config)}
    overrides = {}
    if "data_dir" in fields:  # a benchmark read from files; the Hub is unreachable in tests
        if not DATA.is_dir():
            pytest.skip(f"benchmark data not found at {DATA}")
        overrides["data_dir"] = str(DATA)
    task = entry.build(overrides)
    examples = task.load("test")
    if entry.name in TEST_ROWS and entry.cls.__module__.startswith("gpo."):
        assert len(examples) == TEST_ROWS[entry.name]
    else:
        assert len(examples) >= 1
    messages = task.prompt(examples[0])
    assert isinstance(messages, list) and messages
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) and m["content"] for m in messages)
    assert {m["role"] for m in messages} <= {"system", "user", "assistant"} and messages[-1]["role"] == "user"
    # The question itself reaches the model: some text field of the example is in the last user turn.
    texts = [v for v in examples[0].values() if isinstance(v, str) and len(v) > 3]
    assert any(text in messages[-1]["content"] for text in texts), (examples[0], messages[-1]["content"])


@pytest.mark.parametrize("entry", _entries("selector"))
def test_selector_decides_counts_in_range_deterministically_and_restores_its_state(entry, tmp_path):
    questions, group_size = [4, 0, 9, 2, 7, 5], 8
    rewards = [QuestionRewards(total=v, passed=v) for v in (
        torch.tensor([1.0] * 8), torch.tensor([0.0] * 8), torch.tensor([1.0, 0.0] * 4),
        torch.tensor([1.0, 1.0, 0.0, 1.0] * 2), torch.tensor([0.0] * 8), torch.tensor([0.0, 1.0] * 4))]
    selector, twin = _build(entry, tmp_path), _build(entry, tmp_path)
    for s in (selector, twin):  # two rounds of history, the same on both (as on two ranks)
        for step in range(2):
            counts = s.first_phase(questions, group_size, seed=7 + step)
            screened = [q for q, c in zip(questions, counts) if 0 < c < group_size]
            so_far = [rewards[questions.index(q)] for q in screened]
            so_far = [QuestionRewards(total=r.total[:2], passed=r.total[:2]) for r in so_far]  # the screening rows
            verdicts = s.continue_after(screened, so_far, group_size)
            assert isinstance(verdicts, list) and len(verdicts) == len(screened)
            assert all(isinstance(v, bool) for v in verdicts)
            s.observe(questions, rewards, step=step)
    counts = selector.first_phase(questions, group_size, seed=11)
    assert isinstance(counts, list) and len(counts) == len(questions)
    assert all(isinstance(c, int) and 0 <= c <= group_size for c in counts)
    assert twin.first_phase(questions, group_size, seed=11) == counts  # equal state + seed: equal decisions
    fraction = selector.expected_pass_rate()
    assert fraction is None or 0 < fraction <= 1
    metrics = selector.metrics()
    assert all(k.startswith("select/") and isinstance(v, float) and math.isfinite(v) for k, v in metrics.items())
    restored = _build(entry, tmp_path)
    restored.load_state_dict(selector.state_dict())
    assert restored.first_phase(questions, group_size, seed=12) == selector.first_phase(questions, group_size, seed=12)
