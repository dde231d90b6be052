"""Rollouts in phases, as the selector asks: which prompts each generation call takes, how the phases' rows become
whole groups of G, and what selection saved. Plain records and functions of the selector and a `generate` callable:
the engine's rollout (gpo/rollout.py) passes its backend, the model-free harness (gpo/step_math.py) scripted rewards,
so both run the same phases (docs/architecture.md, "The step").

A selector gives each candidate question a completion count for the first phase (0 skips it, G is its whole
group, anything between screens it); a screened question it continues gets the remaining G - n in a second phase.
The second phase of one round and the first phase of the next are generated in the same calls (one call where the
backend takes a count per prompt; one per distinct count otherwise). Rows carry the candidate's position
(`question`, [N]) until they are assembled into contiguous groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from gpo.errors import UserError
from gpo.ops import no_variance
from gpo.types import QuestionRewards, RolloutBatch, Selector, passes

# Generation seeds. A call's prompts take consecutive seeds from the call's seed (backends add each prompt's place in
# the call), so calls are spaced so that none of a run's calls share a seed: up to PROMPT_SEEDS prompts per call,
# 16 rounds per step and 2**31 / STEP_SEEDS = 32768 steps. (Spaced 31 apart, as before, a round of more than 31
# prompts ran into the next round's seeds, and prompts of one step shared random streams.)
PROMPT_SEEDS = 2048
CONTINUATION_SEED = PROMPT_SEEDS  # a round's second phase, seeded apart from its first
ROUND_SEEDS = 2 * PROMPT_SEEDS
STEP_SEEDS = 16 * ROUND_SEEDS
TOLERANCE = 1e-6  # equal rewards for the zero-variance shares in the metrics (exact for binary rewards)


def generation_seed(run_seed: int, step: int, round_index: int) -> int:
    """The seed of a round's first phase: a function of (run seed, step, round) only, so a resumed run samples the
    same; its second phase takes this + CONTINUATION_SEED."""
    return (run_seed * 1_000_003 + step * STEP_SEEDS + round_index * ROUND_SEEDS) % (2**31)


@dataclass(frozen=True)
class Call:
    """One generation call: `counts[i]` completions for the prompt of `entries[i]` = (ask, candidate position), in
    generation order; `seed` is its first prompt's seed (backends offset it by the prompt's place in the call)."""

    entries: list[tuple[int, int]]
    counts: list[int]
    seed: int

    @property
    def uniform(self) -> bool:
        return len(set(self.counts)) <= 1


def phase_calls(asks: list[tuple[list[int], int]], group_size: int, mixed: bool = False) -> list[Call]:
    """The calls for `asks`, each (completion count per candidate, seed): the phases of one or two rounds generated
    together. With `mixed` (a backend that takes a count per prompt) that is one call over every candidate with a
    count, ask by ask, positions ascending. Otherwise candidates with equal counts share a call, counts ascending.
    A lone ask whose counts are all equal is exactly one call over its candidates in order, seeded by its seed."""
    bad = [c for counts, _ in asks for c in counts if not 0 <= c <= group_size]
    if bad:
        raise UserError(f"selector: completion counts must lie in [0, {group_size}] (G), got {bad[:3]}.")
    entries = [(a, i, c) for a, (counts, _) in enumerate(asks) for i, c in enumerate(counts) if c > 0]
    if not entries:
        return []
    seed = asks[entries[0][0]][1]
    groups = [entries] if mixed else [[e for e in entries if e[2] == n] for n in sorted({e[2] for e in entries})]
    calls, offset = [], 0
    for group in groups:
        calls.append(Call([(a, i) for a, i, _ in group], [c for _, _, c in group], seed + offset))
        offset += len(group)
    return calls


@dataclass
class Round:
    """One round's candidates on their way through the selector's phases: the first-phase counts, then (once the
    selector has seen the screening rewards) the second-phase counts, and every row generated for it so far."""

    pool: list[int]  # the candidates' indices in the task's train pool
    examples: list
    counts: list[int]  # first phase, per candidate
    seed: int
    rows: list[tuple[RolloutBatch, Tensor]] = field(default_factory=list)  # each part's rows, candidate position [N]
    more: list[int] = field(default_factory=list)  # second phase, per candidate; empty until decided

    def screened(self, group_size: int) -> list[int]:
        return [i for i, c in enumerate(self.counts) if 0 < c < group_size]

    @property
    def continued(self) -> int:
        return sum(1 for m in self.more if m)


def split_call(asks: list[Round], call: Call, batch: RolloutBatch) -> None:
    """Hand a call's rows ([sum(call.counts)], entry-major) to the rounds they were generated for."""
    counts = torch.tensor(call.counts)
    ask = torch.tensor([a for a, _ in call.entries]).repeat_interleave(counts)  # [N]
    question = torch.tensor([i for _, i in call.entries]).repeat_interleave(counts)  # [N]
    for a, r in enumerate(asks):
        rows = (ask == a).nonzero(as_tuple=True)[0]
        if rows.numel():
            r.rows.append((batch.select(rows), question[rows]))


def rank_share(m: int, rank: int, world_size: int) -> slice:
    """This rank's contiguous share of m prompts (equal shares when m divides; otherwise they differ by one)."""
    return slice(rank * m // world_size, (rank + 1) * m // world_size)


def rewards_by_question(rows: RolloutBatch, question: Tensor, candidates: int,
                        pass_key: str = "accuracy") -> list[QuestionRewards]:
    """Each candidate's rewards so far (row order; empty for a candidate without rows): the total, every reward
    component, and whether each passes the component named `pass_key` (the task's pass criterion) where the task
    has it."""
    out = []
    for i in range(candidates):
        at = question == i  # [N]
        components = {k: v[at] for k, v in rows.reward_components.items()}
        criterion = components.get(pass_key)
        passed = None if criterion is None else passes(criterion).float()
        out.append(QuestionRewards(total=rows.rewards[at], passed=passed, components=components))
    return out


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
    calls: int = 0  # generation calls (a call shared by two rounds' phases is counted once)

    def add(self, other: RoundLedger) -> RoundLedger:
        return RoundLedger(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def ledger(counts: list[int], continued: int, rewards: list[QuestionRewards], tokens: int,
           group_size: int) -> RoundLedger:
    """The round's accounting from the first-phase counts, how many screened candidates continued, every
    candidate's rewards (all its rows; the zero-variance counts read the total) and the tokens generated."""
    generated = [r.total for r in rewards if len(r)]
    groups = [r for r in generated if r.numel() == group_size]
    screened = sum(1 for c in counts if 0 < c < group_size)
    return RoundLedger(
        considered=len(counts), skipped=counts.count(0), screened=screened, screened_out=screened - continued,
        completions=sum(r.numel() for r in generated), tokens=tokens, generated_questions=len(generated),
        zero_var_generated=sum(no_variance(r, TOLERANCE) for r in generated), groups=len(groups),
        zero_var_groups=sum(no_variance(r, TOLERANCE) for r in groups),
    )


# --- one round's phases ------------------------------------------------------------------------------------------

Generate = Callable[[list, Call], RolloutBatch]  # (the call's examples, the call) -> its rows, rewards filled in


@dataclass(frozen=True)
class Phases:
    """What runs a round's phases: the selector, how a call is generated and scored, and the step's settings."""

    selector: Selector
    generate: Generate
    group_size: int
    pad_token_id: int
    pass_key: str = "accuracy"  # the task's pass criterion: the reward component that says "right"
    mixed: bool = False  # the backend takes a completion count per prompt (one call for mixed counts)


def advance(p: Phases, waiting: Round | None, new: Round | None,
            step: int) -> tuple[list[RolloutBatch], Round | None, RoundLedger]:
    """Generate the waiting round's second phase and the new round's first phase together. The rounds that are then
    complete become whole groups (screened-out rows are only counted); a new round with screened questions the
    selector continues is returned to wait for the next call. Returns (whole-group batches, waiting, accounting)."""
    asks: list[tuple[Round, list[int], int]] = []  # (round, completion count per candidate, seed)
    if waiting is not None:  # its second phase, seeded apart from its first
        asks.append((waiting, waiting.more, (waiting.seed + CONTINUATION_SEED) % (2**31)))
    if new is not None:
        asks.append((new, new.counts, new.seed))
    calls = phase_calls([(counts, seed) for _, counts, seed in asks], p.group_size, mixed=p.mixed)
    for call in calls:
        examples = [asks[a][0].examples[i] for a, i in call.entries]
        split_call([r for r, _, _ in asks], call, p.generate(examples, call))
    done = [] if waiting is None else [waiting]
    waiting = new if new is not None and choose_second_phase(p, new) else None
    if new is not None and waiting is None:
        done.append(new)
    spent = RoundLedger(calls=len(calls))
    finished = []
    for r in done:
        batch, round_spent = finish(p, r, step)
        finished.append(batch)
        spent = spent.add(round_spent)
    return finished, waiting, spent


def choose_second_phase(p: Phases, r: Round) -> bool:
    """Ask the selector which screened questions go on to G; True when any does (the round then waits)."""
    G, screened = p.group_size, r.screened(p.group_size)
    if not screened:
        return False
    rows, question = joined(r.rows, p.pad_token_id)
    so_far = rewards_by_question(rows, question, len(r.counts), p.pass_key)
    verdicts = p.selector.continue_after([r.pool[i] for i in screened], [so_far[i] for i in screened], G)
    go = {i for i, v in zip(screened, verdicts, strict=True) if v}
    r.more = [G - c if i in go else 0 for i, c in enumerate(r.counts)]
    return bool(go)


def finish(p: Phases, r: Round, step: int) -> tuple[RolloutBatch, RoundLedger]:
    """A round whose phases are done: the selector observes every candidate's rewards (empty for a skipped one),
    and the candidates with exactly G rows become contiguous whole groups (group_ids 0..B'-1)."""
    G = p.group_size
    rows, question = joined(r.rows, p.pad_token_id)
    per_question = rewards_by_question(rows, question, len(r.counts), p.pass_key)  # screening rows included
    p.selector.observe(r.pool, per_question, step)
    spent = ledger(r.counts, r.continued, per_question, int(rows.lengths.sum()), G)
    batch = rows.select(whole_groups(question, G))
    batch.group_ids = torch.arange(len(batch) // G).repeat_interleave(G)  # [N]
    return batch, spent
