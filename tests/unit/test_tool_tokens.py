"""Tokens a tool or an environment wrote into a trajectory are read by the model and trained by nobody: for every
objective the loss, its gradient and the step's counts are what they would be without those tokens at all, and a
batch without any has exactly today's loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpo import registry
from gpo.step_math import step_totals, with_loss_mask
from gpo.types import RolloutBatch, model_tokens_only
from kit import build_objective

registry.load_builtins()
OBJECTIVES = sorted(registry.names("algo"))


def trajectory_batch(seed: int = 0) -> tuple[RolloutBatch, torch.Tensor]:
    """Four rows of 9 completion columns; rows 0 and 2 hold a 3-token tool result between two model turns. Returns
    the batch and bool [4, 9] of the tool tokens."""
    gen = torch.Generator().manual_seed(seed)
    n, width = 4, 9
    tool = torch.zeros(n, width, dtype=torch.bool)
    tool[0, 2:5] = True
    tool[2, 3:6] = True
    present = (torch.arange(width) < torch.tensor([8, 5, 9, 3]).unsqueeze(1))  # [N, L]
    old = -torch.rand(n, width, generator=gen, dtype=torch.float64)
    return RolloutBatch(
        prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
        completion_ids=torch.randint(3, 50, (n, width), generator=gen), completion_mask=(present & ~tool).long(),
        group_ids=torch.tensor([0, 0, 1, 1]), rewards=torch.tensor([1.0, 0.0, 0.5, 0.2], dtype=torch.float64),
        advantages=torch.tensor([0.7, -0.7, 0.4, -0.4], dtype=torch.float64),
        truncated=torch.zeros(n, dtype=torch.bool),
        owner_rank=torch.zeros(n, dtype=torch.long), old_logprobs=old, ref_logprobs=old.flip(1),
        tool_tokens=tool & present,
    ), tool & present


def without_columns(batch: RolloutBatch, tool: torch.Tensor, x: torch.Tensor) -> tuple[RolloutBatch, torch.Tensor]:
    """The same rows with every tool token cut out (later tokens moved left), and `x` [N, L] cut alike."""
    keep = ~tool
    width = int(keep.sum(dim=1).max())

    def cut(t):
        if t is None:
            return None
        out = torch.zeros((t.shape[0], width), dtype=t.dtype)
        for i in range(t.shape[0]):
            row = t[i][keep[i]]
            out[i, : len(row)] = row
        return out

    cut_batch = dataclasses.replace(batch, completion_ids=cut(batch.completion_ids),
                                    completion_mask=cut(batch.completion_mask), old_logprobs=cut(batch.old_logprobs),
                                    ref_logprobs=cut(batch.ref_logprobs), tool_tokens=None)
    return cut_batch, cut(x)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_every_objective_trains_as_if_the_tool_tokens_were_not_there(name):
    objective = build_objective(name, max_completion_length=9)
    batch, tool = trajectory_batch()
    gen = torch.Generator().manual_seed(1)
    logp = (batch.old_logprobs + 0.2 * torch.randn(batch.old_logprobs.shape, generator=gen,
                                                   dtype=torch.float64)).requires_grad_()
    filled = with_loss_mask(objective, batch)
    assert not (filled.loss_mask.bool() & tool).any()
    loss, _ = objective.loss(logp, filled, step_totals(objective, filled))
    loss.backward()
    assert torch.equal(logp.grad[tool], torch.zeros(int(tool.sum()), dtype=logp.dtype))  # no gradient, no KL

    cut, cut_logp = without_columns(batch, tool, logp.detach())
    cut_filled = with_loss_mask(objective, cut)
    assert step_totals(objective, filled) == step_totals(objective, cut_filled)  # denominators
    assert torch.equal(batch.lengths, cut.lengths)  # length metrics and DAPO's overlong rule
    cut_loss, _ = objective.loss(cut_logp, cut_filled, step_totals(objective, cut_filled))
    assert loss.item() == pytest.approx(cut_loss.item(), rel=1e-12, abs=1e-15)

    # whatever the log-probs at tool tokens are, the loss does not move
    noisy = logp.detach().clone()
    noisy[tool] -= 5.0
    moved = dataclasses.replace(filled, old_logprobs=filled.old_logprobs.masked_fill(tool, -9.0),
                                ref_logprobs=filled.ref_logprobs.masked_fill(tool, -7.0))
    assert objective.loss(noisy, moved, step_totals(objective, moved))[0].item() == pytest.approx(loss.item(),
                                                                                                  rel=1e-12)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_a_batch_without_tool_tokens_has_todays_loss_and_gradient(name):
    objective = build_objective(name, max_completion_length=9)
    batch, _ = trajectory_batch(seed=2)
    plain = dataclasses.replace(batch, tool_tokens=None, completion_mask=batch.attended)
    marked = dataclasses.replace(plain, tool_tokens=torch.zeros_like(plain.completion_mask, dtype=torch.bool))
    grads, losses = [], []
    for b in (plain, marked):
        logp = (b.old_logprobs + 0.1).requires_grad_()
        filled = with_loss_mask(objective, b)
        loss, _ = objective.loss(logp, filled, step_totals(objective, filled))
        loss.backward()
        losses.append(loss.detach())
        grads.append(logp.grad)
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])


def test_a_plug_in_mask_of_all_ones_still_leaves_tool_tokens_out():
    batch, tool = trajectory_batch()
    ones = torch.ones_like(batch.completion_mask)
    assert torch.equal(model_tokens_only(ones, batch).bool(), ~tool)
    assert torch.equal(model_tokens_only(ones.bool(), batch), ~tool)


def test_selecting_concatenating_and_trimming_carry_the_tool_tokens():
    batch, tool = trajectory_batch()
    picked = batch.select(torch.tensor([1, 3]))  # rows without tool tokens: trimmed to their own width
    assert picked.tool_tokens.shape == picked.completion_ids.shape and not picked.tool_tokens.any()
    assert picked.completion_ids.shape[1] == 5
    single = dataclasses.replace(batch.select(torch.tensor([1])), tool_tokens=None)
    joined = RolloutBatch.concat([batch, single])
    assert joined.tool_tokens.shape == joined.completion_ids.shape
    assert torch.equal(joined.tool_tokens[:4], tool) and not joined.tool_tokens[4].any()
    assert torch.equal(joined.attended[:4], batch.attended)
