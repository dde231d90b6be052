"""A training step's maths on a RolloutBatch, without a model: what `Engine.step` calls between generation and the
optimizer, public so that an algorithm or a pruner can be checked on a hand-made batch.

    from gpo.step_math import score_groups, kept_rows, step_totals, loss_shares
    scored, group_keep = score_groups(objective, batch, group_size=4)  # shaped rewards, advantages, filter [B]
    candidates, keep = kept_rows(pruner, scored, group_keep, group_size=4)  # whole kept groups, pruner's mask
    kept = candidates.select(keep)
    shares = loss_shares(objective, kept, logp, micro_batch_size=2)  # logp [N, L]: any policy's, or made up

Every function is pure: the components it is given decide, nothing is loaded, nothing is communicated (a
multi-rank step sums `step_totals` over ranks before the loss; the engine does that).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from gpo.logprobs import micro_batches
from gpo.types import Objective, Pruner, RolloutBatch, StepTotals


def shaped_rewards(objective: Objective, batch: RolloutBatch, group_size: int) -> Tensor:
    """The objective's reward shaping (e.g. DAPO's overlong penalty) of the batch's whole groups: [B, G]."""
    G = group_size
    return objective.shape_rewards(batch.rewards.view(-1, G), batch.lengths.view(-1, G), batch.truncated.view(-1, G))


def group_filter(objective: Objective, batch: RolloutBatch, shaped: Tensor, group_size: int) -> Tensor:
    """bool [B]: the groups the objective trains on, judged on the shaped rewards and the raw reward components."""
    components = {k: v.view(-1, group_size) for k, v in batch.reward_components.items()}  # name -> [B, G]
    return objective.group_filter(shaped, components)


def score_groups(objective: Objective, batch: RolloutBatch, group_size: int) -> tuple[RolloutBatch, Tensor]:
    """The batch with shaped rewards and advantages (over each whole group, before any pruning), and the group
    filter's verdict [B]. `batch` holds whole groups of `group_size` contiguous rows."""
    shaped = shaped_rewards(objective, batch, group_size)  # [B, G]
    keep = group_filter(objective, batch, shaped, group_size)  # [B]
    advantages = objective.advantages(shaped)  # [B, G]
    return dataclasses.replace(batch, rewards=shaped.flatten(), advantages=advantages.flatten()), keep


def kept_rows(pruner: Pruner, batch: RolloutBatch, group_keep: Tensor, group_size: int,
              multiple_of: int = 1) -> tuple[RolloutBatch, Tensor]:
    """The rows of the groups the filter kept, and the pruner's mask over them ([N_kept_groups] bool), topped up by
    the pruner's own score to a multiple of `multiple_of` (the world size: every rank trains as many rows)."""
    candidates = batch.select(group_keep.repeat_interleave(group_size))
    if len(candidates) == 0:
        return candidates, torch.zeros(0, dtype=torch.bool)
    return candidates, pruner.keep(candidates, multiple_of=multiple_of)


def step_totals(objective: Objective, batch: RolloutBatch) -> StepTotals:
    """Rows and loss tokens of `batch`: what the objective divides by (summed over ranks for a multi-rank step)."""
    return StepTotals(sequences=len(batch), tokens=int(objective.loss_mask(batch).sum()))


def loss_shares(objective: Objective, batch: RolloutBatch, logp: Tensor, micro_batch_size: int,
                totals: StepTotals | None = None) -> list[tuple[Tensor, dict[str, Tensor]]]:
    """Each micro-batch's share of the step loss and its metrics, given the whole batch's log-probs `logp` [N, L].
    The shares sum to the step loss whatever `micro_batch_size` is; `totals` defaults to this batch's own."""
    totals = totals or step_totals(objective, batch)
    out, row = [], 0
    for mb in micro_batches(batch, micro_batch_size):
        out.append(objective.loss(logp[row:row + len(mb), :mb.completion_ids.shape[1]], mb, totals))
        row += len(mb)
    return out
