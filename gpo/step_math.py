"""A training step's maths on a RolloutBatch, without a model: what `Engine.step` calls between generation and the
optimizer, public so that an algorithm or a pruner can be checked on a hand-made batch.

    from gpo.step_math import score_groups, kept_rows, with_loss_mask, corrected, step_totals, loss_shares
    scored, group_mask = score_groups(objective, batch, group_size=4)  # shaped rewards, advantages, filter [B]
    candidates, keep = kept_rows(pruner, scored, group_mask, group_size=4)  # the filter's groups, pruner's mask
    kept = with_loss_mask(objective, candidates.select(keep))  # the objective's loss mask, once for the step
    kept, counts = corrected(correction, objective, kept, old_logprobs)  # with generator log-probs: weights, mask
    shares = loss_shares(objective, kept, logp, micro_batch_size=2)  # logp [N, L]: any policy's, or made up
    run = select(selector, {7: {"total": [2, 1, 2, 1], "accuracy": [1, 0, 1, 0]}}, group_size=4)  # a selector

Every function is pure: the components it is given decide, nothing is loaded, nothing is communicated (a
multi-rank step sums `step_totals` over ranks before the loss; the engine does that).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gpo.logprobs import micro_batches
from gpo.rollout_phases import Call, Phases, Round, RoundLedger, advance, generation_seed
from gpo.types import (
    Correction,
    Objective,
    Pruner,
    RolloutBatch,
    Selector,
    StepTotals,
    loss_mask_of,
    model_tokens_only,
    passes,
)


def shaped_rewards(objective: Objective, batch: RolloutBatch, group_size: int) -> Tensor:
    """The objective's reward shaping (e.g. DAPO's overlong penalty) of the batch's whole groups: [B, G]."""
    G = group_size
    return objective.shape_rewards(batch.rewards.view(-1, G), batch.lengths.view(-1, G), batch.truncated.view(-1, G))


def group_filter(objective: Objective, batch: RolloutBatch, shaped: Tensor, group_size: int,
                 pass_key: str = "accuracy") -> Tensor:
    """bool [B]: the groups the objective trains on, judged on the shaped rewards, the raw reward components and each
    completion's verdict by the task's pass criterion, the component named `pass_key` (`gpo.types.passes`; none
    when the batch lacks that component)."""
    components = {k: v.view(-1, group_size) for k, v in batch.reward_components.items()}  # name -> [B, G]
    passed = passes(components[pass_key]) if pass_key in components else None  # [B, G]
    if passed is None or not takes_verdicts(objective):  # a plug-in written against the two-argument filter
        return objective.group_filter(shaped, components)
    return objective.group_filter(shaped, components, passed=passed)


def takes_verdicts(objective: Objective) -> bool:
    """Whether the objective's `group_filter` takes the `passed` verdicts (every built-in does; a plug-in's
    override from before they existed takes only rewards and components, and keeps working). Read once per
    objective class."""
    return _filter_takes_verdicts(type(objective))


@functools.cache
def _filter_takes_verdicts(cls: type) -> bool:
    try:
        parameters = inspect.signature(cls.group_filter).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return True
    return "passed" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def score_groups(objective: Objective, batch: RolloutBatch, group_size: int,
                 pass_key: str = "accuracy") -> tuple[RolloutBatch, Tensor]:
    """The batch with shaped rewards and advantages (over each whole group, before any pruning), and the group
    filter's verdict [B]. `batch` holds whole groups of `group_size` contiguous rows; `pass_key` names the task's
    pass criterion (`gpo.types.pass_criterion`), what DAPO's filter and the selectors judge by."""
    shaped = shaped_rewards(objective, batch, group_size)  # [B, G]
    group_mask = group_filter(objective, batch, shaped, group_size, pass_key)  # [B]
    advantages = objective.advantages(shaped)  # [B, G]
    return dataclasses.replace(batch, rewards=shaped.flatten(), advantages=advantages.flatten()), group_mask


def kept_rows(pruner: Pruner, batch: RolloutBatch, group_mask: Tensor, group_size: int,
              multiple_of: int = 1) -> tuple[RolloutBatch, Tensor]:
    """The rows of the groups the filter let through (`group_mask` [B]), and the pruner's mask over them (bool, one per
    such row), topped up by the pruner's own score to a multiple of `multiple_of` (the world size: every rank trains
    as many rows)."""
    candidates = batch.select(group_mask.repeat_interleave(group_size))
    if len(candidates) == 0:
        return candidates, torch.zeros(0, dtype=torch.bool)
    return candidates, pruner.keep(candidates, multiple_of=multiple_of)


def within_staleness(rows: RolloutBatch, step: int, max_staleness: int) -> tuple[RolloutBatch, Tensor]:
    """The rows that step `step` may train, those sampled at most `max_staleness` policy versions ago, and every
    row's staleness ([N] long: step - version; 0 where rows carry no version)."""
    versions = rows.versions if rows.versions is not None else torch.full((len(rows),), step, dtype=torch.long)
    staleness = step - versions.long()  # [N]
    within = staleness <= max_staleness
    return (rows if bool(within.all()) else rows.select(within)), staleness


def with_loss_mask(objective: Objective, batch: RolloutBatch) -> RolloutBatch:
    """`batch` with `loss_mask` filled from the objective's `loss_mask(batch)`, the one call per step: the step's
    totals, the correction and every micro-batch's loss then read the field (selecting, concatenating, moving and
    sharding rows carry it). A batch whose mask is filled already is returned as it is."""
    if batch.loss_mask is not None:
        return batch
    return dataclasses.replace(batch, loss_mask=model_tokens_only(objective.loss_mask(batch), batch))


def step_totals(objective: Objective, batch: RolloutBatch) -> StepTotals:
    """Rows and loss tokens of `batch`: what the objective divides by (summed over ranks for a multi-rank step).

    Tokens the correction dropped (`batch.is_mask`) do not count, and a row whose every loss token it dropped
    leaves the row count; a row the objective itself masks whole (e.g. DAPO's truncated rows) still counts."""
    mask = loss_mask_of(objective, batch).bool()  # [N, L]
    counted = batch.counted(mask)  # [N, L]
    dropped_rows = int((mask.any(dim=1) & ~counted.any(dim=1)).sum())
    return StepTotals(sequences=len(batch) - dropped_rows, tokens=int(counted.sum()))


def corrected(correction: Correction, objective: Objective, batch: RolloutBatch, old_logprobs: Tensor,
              may_mask: bool = True) -> tuple[RolloutBatch, dict[str, float]]:
    """`batch` (which has the generator's log-probs) with the correction's weights and token mask (`is_weights`,
    `is_mask`), from pi_old's log-probs `old_logprobs` [N, L], and the counts its metrics are made of.

    The counts are sums over the objective's loss tokens (and `_max` maxima), to be summed over micro-batches and
    ranks before `gpo.metrics.mismatch_metrics` divides them. `may_mask` False: the caller has counted the step's
    tokens already, so a correction that drops a token here is an error."""
    if batch.generator_logprobs is None:
        raise ValueError("corrected() needs a batch with the generator's log-probs (generator_logprobs)")
    loss_mask = loss_mask_of(objective, batch).bool().to(old_logprobs.device)  # [N, L]
    old = old_logprobs.detach().float()
    generator = batch.generator_logprobs.to(old.device).float()
    out = correction.correct(old, generator, loss_mask)
    if not may_mask and bool((loss_mask & ~out.mask).any()):
        raise ValueError(f"{type(correction).__name__} dropped tokens but declares masks = False; set masks = True "
                         f"so that the engine knows pi_old before it counts the step's tokens")
    return (dataclasses.replace(batch, is_weights=out.weights.detach(), is_mask=out.mask),
            mismatch_counts(old, generator, loss_mask, out.weights, out.mask, out.truncated))


def mismatch_counts(old_logprobs: Tensor, generator_logprobs: Tensor, mask: Tensor, weights: Tensor, is_mask: Tensor,
                    truncated: Tensor) -> dict[str, float]:
    """Sums over the loss tokens (`mask`, [N, L]) of d = log pi_old - log pi_generator and of the correction's work
    (`weights`, its token mask `is_mask`, the `truncated` tokens).

    `kl_sum` sums k3 = exp(d) - 1 - d, Schulman's estimator of KL(pi_generator || pi_old) from tokens sampled by the
    generator (r = pi_old / pi_generator, k3 = (r - 1) - log r >= 0). `logp_abs_max` is a maximum (-inf without tokens).
    """
    m = mask.bool()
    d = (old_logprobs.double() - generator_logprobs.double())[m]  # [tokens]
    left, dropped, capped = is_mask & m, ~is_mask & m, truncated & m  # [N, L] each
    return {
        "tokens": float(m.sum()),
        "rows": float(m.any(dim=1).sum()),
        "logp_abs_sum": float(d.abs().sum()),
        "logp_abs_max": float(d.abs().max()) if d.numel() else -math.inf,
        "kl_sum": float((torch.exp(d) - 1 - d).sum()),
        "left": float(left.sum()),
        "weight_sum": float(weights.double()[left].sum()),
        "truncated": float(capped.sum()),
        "masked": float(dropped.sum()),
        "truncated_rows": float(capped.any(dim=1).sum()),
        "masked_rows": float(dropped.any(dim=1).sum()),
    }


def loss_shares(objective: Objective, batch: RolloutBatch, logp: Tensor, micro_batch_size: int,
                totals: StepTotals | None = None) -> list[tuple[Tensor, dict[str, Tensor]]]:
    """Each micro-batch's share of the step loss and its metrics, given the whole batch's log-probs `logp` [N, L].
    The shares sum to the step loss whatever `micro_batch_size` is; `totals` defaults to this batch's own. The
    objective's loss mask is computed once, for the whole batch (`with_loss_mask`)."""
    batch = with_loss_mask(objective, batch)
    totals = totals or step_totals(objective, batch)
    out, row = [], 0
    for mb in micro_batches(batch, micro_batch_size):
        out.append(objective.loss(logp[row:row + len(mb), :mb.completion_ids.shape[1]], mb, totals))
        row += len(mb)
    return out


@dataclass(frozen=True)
class SelectionRun:
    """What one round of a selector's phases did: completions generated per question, the questions that got a
    whole group to train on, those skipped (no completion) and those screened out (screened, not continued)."""

    generated: dict[int, int]
    trained: list[int]
    skipped: list[int]
    screened_out: list[int]
    ledger: RoundLedger


def select(selector: Selector, rewards: Mapping[int, Mapping[str, Sequence[float]]], group_size: int, step: int = 0,
           run_seed: int = 0, pass_key: str = "accuracy", mixed: bool = False) -> SelectionRun:
    """Run one round of `selector` over the questions of `rewards` (keys, in order), exactly as the engine's rollout
    does (gpo.rollout_phases.advance: first phase, screening rewards, continue to G, observe), on scripted rewards:
    `rewards[q]` maps "total" and each reward component to at least G values, the j-th given to q's j-th completion
    (screening rows first). The selector's state changes as in a run; call again for the next step."""
    pool = list(rewards)
    given = dict.fromkeys(pool, 0)

    def generate(examples: list, call: Call) -> RolloutBatch:
        totals: list[float] = []
        components: dict[str, list[float]] = {k: [] for k in rewards[pool[0]] if k != "total"} if pool else {}
        for q, n in zip(examples, call.counts, strict=True):
            start, given[q] = given[q], given[q] + n
            totals += [float(v) for v in rewards[q]["total"][start:start + n]]
            for k in components:
                components[k] += [float(v) for v in rewards[q][k][start:start + n]]
        if len(totals) != sum(call.counts):
            raise ValueError(f"scripted rewards hold fewer than the {group_size} values each question may need")
        return _scripted_rows(totals, components)

    phases = Phases(selector, generate, group_size, pad_token_id=0, pass_key=pass_key, mixed=mixed)
    seed = generation_seed(run_seed, step, 0)
    first = Round(pool, pool, selector.first_phase(pool, group_size, seed=seed), seed)
    finished, waiting, spent = advance(phases, None, first, step)
    if waiting is not None:
        more, _, rest = advance(phases, waiting, None, step)
        finished, spent = finished + more, spent.add(rest)
    trained = [q for q in pool if given[q] == group_size]
    assert sum(len(b) for b in finished) == len(trained) * group_size  # the whole groups the rollout built
    return SelectionRun(generated=dict(given), trained=trained, skipped=[q for q, c in zip(pool, first.counts,
                                                                                              strict=True) if c == 0],
                        screened_out=[q for q in pool if 0 < given[q] < group_size], ledger=spent)


def _scripted_rows(totals: list[float], components: dict[str, list[float]]) -> RolloutBatch:
    """Rows of one token each carrying the given rewards: enough of a batch for the selection phases."""
    n = len(totals)
    one = torch.ones((n, 1), dtype=torch.long)
    return RolloutBatch(prompt_ids=one, prompt_mask=one, completion_ids=one, completion_mask=one,
                        group_ids=torch.zeros(n, dtype=torch.long), rewards=torch.tensor(totals, dtype=torch.float32),
                        advantages=torch.zeros(n), truncated=torch.zeros(n, dtype=torch.bool),
                        owner_rank=torch.zeros(n, dtype=torch.long),
                        reward_components={k: torch.tensor(v, dtype=torch.float32) for k, v in components.items()})
