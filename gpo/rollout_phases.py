"""Rollouts in phases, as the selector asks: which prompts each generation call takes, how the phases' rows become
whole groups of G, and what selection saved. Pure functions; the engine runs the calls.

A selector gives each candidate question a completion count for the first phase (0 skips it, G is its whole
group, anything between screens it); a screened question it continues gets the remaining G - n in a second phase.
Rows carry the candidate's position (`question`, [N]) until they are assembled into contiguous groups.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from gpo.errors import UserError
from gpo.selectors.variance import no_variance
from gpo.types import RolloutBatch

CONTINUATION_SEED = 1_000_033  # offsets a round's second-phase generation seeds from its first phase's
TOLERANCE = 1e-6  # equal rewards for the zero-variance shares in the metrics (exact for binary rewards)


@dataclass(frozen=True)
class Call:
    """One generation call: `n` completions for each of `questions` (candidate positions, in generation order);
    `offset` is the position of its first prompt among the phase's prompts (the seed offset)."""

    questions: list[int]
    n: int
    offset: int


def phase_calls(counts: list[int], group_size: int) -> list[Call]:
    """The calls of one phase: candidates with the same count share a call, counts ascending, positions ascending
    within a call, so a phase where every count is G is exactly one call over all candidates in order."""
    bad = [c for c in counts if not 0 <= c <= group_size]
    if bad:
        raise UserError(f"selector: completion counts must lie in [0, {group_size}] (G), got {bad[:3]}.")
    calls, offset = [], 0
    for n in sorted({c for c in counts if c > 0}):
        questions = [i for i, c in enumerate(counts) if c == n]
        calls.append(Call(questions, n, offset))
        offset += len(questions)
    return calls


def rank_share(m: int, rank: int, world_size: int) -> slice:
    """This rank's contiguous share of m prompts (equal shares when m divides; otherwise they differ by one)."""
    return slice(rank * m // world_size, (rank + 1) * m // world_size)


def rewards_by_question(rewards: Tensor, question: Tensor, candidates: int) -> list[Tensor]:
    """rewards [N] and question [N] -> each candidate's rewards so far ([n_i], in row order; empty if none)."""
    return [rewards[question == i] for i in range(candidates)]


def whole_groups(question: Tensor, group_size: int) -> Tensor:
    """Row indices [B'*G] of the candidates that got exactly G rows, grouped by candidate position ascending; within a
    group rows keep their order (screening rows first). Candidates screened out (fewer rows) are left out."""
    if question.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    counts = torch.bincount(question)
    rows = (counts[question] == group_size).nonzero(as_tuple=True)[0]
    return rows[torch.sort(question[rows], stable=True).indices]

def joined(parts: list[tuple[RolloutBatch, torch.Tensor]], pad_token_id: int) -> tuple[RolloutBatch, torch.Tensor]:
    """A phase's calls as one batch, and each row's candidate position ([N])."""
    if not parts:
        return no_rows(), torch.zeros(0, dtype=torch.long)
    return (RolloutBatch.concat([b for b, _ in parts], pad_token_id), torch.cat([q for _, q in parts]))


def no_rows() -> RolloutBatch:
    """An empty batch (a round whose selector skipped every candidate)."""
    ids, n = torch.zeros((0, 1), dtype=torch.long), torch.zeros(0)
    return RolloutBatch(prompt_ids=ids, prompt_mask=ids, completion_ids=ids, completion_mask=ids,
                        group_ids=torch.zeros(0, dtype=torch.long), rewards=n, advantages=n,
                        truncated=torch.zeros(0, dtype=torch.bool), owner_rank=torch.zeros(0, dtype=torch.long))


@dataclass
class RoundLedger:
    """What one round's selection did; summed over a step's rounds for the metrics."""

    considered: int = 0  # candidates the allocator drew
    skipped: int = 0  # given no completion at all
    screened: int = 0  # given fewer than G first
    screened_out: int = 0  # screened and not continued
    completions: int = 0  # completions generated, screening rows included
    tokens: int = 0  # tokens generated in them
    generated_questions: int = 0  # candidates with at least one completion
    zero_var_generated: int = 0  # of those, with equal rewards over all their rows
    groups: int = 0  # whole groups of G
    zero_var_groups: int = 0  # of those, with equal rewards

    def add(self, other: RoundLedger) -> RoundLedger:
        return RoundLedger(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def ledger(counts: list[int], continued: int, rewards: list[Tensor], tokens: int, group_size: int) -> RoundLedger:
    """The round's accounting from the first-phase counts, how many screened candidates continued, every
    candidate's rewards (all its rows) and the tokens generated."""
    generated = [r for r in rewards if r.numel()]
    groups = [r for r in generated if r.numel() == group_size]
    screened = sum(1 for c in counts if 0 < c < group_size)
    return RoundLedger(
        considered=len(counts), skipped=counts.count(0), screened=screened, screened_out=screened - continued,
        completions=sum(r.numel() for r in generated), tokens=tokens, generated_questions=len(generated),
        zero_var_generated=sum(no_variance(r, TOLERANCE) for r in generated), groups=len(groups),
        zero_var_groups=sum(no_variance(r, TOLERANCE) for r in groups),
    )
