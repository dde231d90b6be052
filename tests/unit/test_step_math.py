"""gpo.step_math: a step's maths on a hand-made RolloutBatch, no model loaded, and the engine going through it."""

from __future__ import annotations

import math

import pytest
import torch

from gpo import registry
from gpo.step_math import group_filter, kept_rows, loss_shares, score_groups, shaped_rewards, step_totals
from gpo.types import RolloutBatch

registry.load_builtins()


def hand_batch(rewards, group_size, accuracy=None, lengths=None, width=4):
    """Rows in groups of `group_size`; row i has `lengths[i]` completion tokens (default: all `width`)."""
    n = len(rewards)
    lengths = lengths or [width] * n
    mask = torch.tensor([[1] * k + [0] * (width - k) for k in lengths])  # [N, L]
    comps = {"accuracy": torch.tensor(accuracy if accuracy is not None else rewards, dtype=torch.float32)}
    return RolloutBatch(
        prompt_ids=(torch.arange(n) // group_size + 5).reshape(n, 1),
        prompt_mask=torch.ones(n, 1, dtype=torch.long),
        completion_ids=torch.arange(n * width).reshape(n, width) % 50 + 10,
        completion_mask=mask,
        group_ids=torch.arange(n) // group_size,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        advantages=torch.zeros(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        owner_rank=torch.zeros(n, dtype=torch.long),
        reward_components=comps,
    )


def objective(name, **cfg):
    return registry.get("algo", name).build(cfg, max_completion_length=4)


def test_grpo_advantages_by_hand():
    # Group 1 rewards [1, 0, 0, 1]: mean 0.5, Bessel std sqrt(1/3) = 0.57735; A = +-0.5 / (0.57735 + 1e-4).
    # Group 2 rewards all 1: std 0, A = 0 (no signal; the filter of GRPO keeps it anyway).
    batch = hand_batch([1, 0, 0, 1, 1, 1, 1, 1], group_size=4)
    scored, group_mask = score_groups(objective("grpo"), batch, group_size=4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert torch.allclose(scored.advantages, torch.tensor([a, -a, -a, a, 0, 0, 0, 0]), atol=1e-6)
    assert group_mask.tolist() == [True, True]
    assert torch.equal(scored.rewards, batch.rewards)  # GRPO shapes nothing


def test_dapo_filter_and_overlong_shaping_by_hand():
    # DAPO's soft overlong penalty lowers only the rewards of completions near max_completion_length (4 here); its
    # dynamic-sampling filter drops groups whose accuracy is all equal.
    algo = objective("dapo")
    batch = hand_batch([1, 0, 1, 0, 1, 1, 1, 1], group_size=4, lengths=[1, 1, 4, 4, 1, 1, 1, 1])
    shaped = shaped_rewards(algo, batch, 4)
    assert shaped.shape == (2, 4)
    assert (shaped[0, 2:] <= batch.rewards.view(2, 4)[0, 2:]).all()  # the long rows are never rewarded more
    assert torch.equal(shaped[0, :2], batch.rewards.view(2, 4)[0, :2])  # short rows are left alone
    assert group_filter(algo, batch, shaped, 4).tolist() == [True, False]  # group 2's accuracy has no variance


def test_kept_rows_are_the_filtered_groups_top_k_by_abs_advantage():
    # Distinct |A| in each group (topk breaks ties at random, by its seed). Group 1 rewards [1, 0, .6, .3]: mean
    # .475, gaps .525 .475 .125 .175 -> rows 0 and 1. Group 3 [.9, .1, .5, 0]: mean .375, gaps .525 .275 .125 .375
    # -> its rows 0 and 3 (candidates 4 and 7). The middle group is dropped by the filter before pruning.
    batch = hand_batch([1, 0, .6, .3, 1, 1, 1, 1, .9, .1, .5, 0], group_size=4)
    scored, _ = score_groups(objective("grpo"), batch, 4)
    pruner = registry.get("pruner", "topk").build({"rate": 0.5})
    group_mask = torch.tensor([True, False, True])
    candidates, keep = kept_rows(pruner, scored, group_mask, 4)
    assert len(candidates) == 8 and candidates.group_ids.tolist() == [0, 0, 0, 0, 2, 2, 2, 2]
    assert keep.nonzero().flatten().tolist() == [0, 1, 4, 7]
    _, padded = kept_rows(pruner, scored, group_mask, 4, multiple_of=3)  # 4 kept -> topped up to 6 by |A|
    added = (padded & ~keep).nonzero().flatten().tolist()
    pruned_by_size = sorted((~keep).nonzero().flatten().tolist(), key=lambda i: -float(candidates.advantages[i].abs()))
    assert int(padded.sum()) == 6 and padded[keep].all() and sorted(added) == sorted(pruned_by_size[:2])


@pytest.mark.parametrize("algo", ["grpo", "dr_grpo", "gspo", "cispo"])
def test_loss_shares_sum_to_the_whole_batch_loss_for_any_micro_batch_size(algo):
    obj = objective(algo, beta=0.0)
    batch = hand_batch([1, 0, 0, 1, 1, 0, 1, 1], group_size=4, lengths=[4, 2, 3, 1, 4, 4, 2, 3])
    scored, _ = score_groups(obj, batch, 4)
    logp = -torch.rand(8, 4, generator=torch.Generator().manual_seed(0)) - 0.1  # [N, L] any policy's log-probs
    whole = sum(loss for loss, _ in loss_shares(obj, scored, logp, micro_batch_size=8))
    for size in (1, 3, 5):
        shares = loss_shares(obj, scored, logp, micro_batch_size=size)
        assert len(shares) == math.ceil(8 / size)
        assert torch.allclose(sum(loss for loss, _ in shares), whole, atol=1e-6)
    totals = step_totals(obj, scored)
    assert (totals.sequences, totals.tokens) == (8, 23)


def test_the_engine_step_goes_through_the_seam(tiny_model_path, tmp_path, monkeypatch):
    """Engine.step's advantages and kept rows are those of gpo.step_math (the functions the rollout and the engine
    call)."""
    import gpo.rollout
    from gpo.config import compose
    from gpo.engine import Engine

    calls = {"score_groups": 0, "kept_rows": 0}
    for name in calls:
        module = gpo.rollout
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    engine = Engine(compose([f"model.path={tiny_model_path}", "tracker=none", f"output_dir={tmp_path}",
                             "train.group_size=4", "train.questions_per_step=1", "train.max_completion_length=4",
                             "allocator=static", "pruner=topk", "pruner.rate=0.5"]))
    metrics = engine.step()
    assert calls == {"score_groups": 1, "kept_rows": 1}
    assert metrics["train/rows"] == 2  # 1 question x 4 completions, half kept
