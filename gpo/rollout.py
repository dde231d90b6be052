"""A step's rollouts: the allocator's rounds of questions, the selector's phases, generation and rewards, until the
step's slots are filled. Iterating a `StepRollout` yields each finished batch of whole groups with its group filter;
the engine prunes it and hands the kept rows back (`record`), which tells the allocator how full the step is.

    rollout = Rollout(...).plan(step, timer)
    for batch, group_keep in rollout:           # whole groups, shaped rewards and advantages, filter [B]
        rollout.record(*kept_rows(pruner, batch, group_keep, G))
    kept = rollout.kept()

The phases themselves are the pure code of gpo/rollout_phases.py (docs/architecture.md, "The step").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gpo.distributed import all_gather_batch, all_reduce_sum
from gpo.generation import completion_tokens, decode_completions, encode_prompts, generate
from gpo.metrics import PhaseTimer, rollout_metrics
from gpo.parallel import gathered
from gpo.rewards import score as score_completions
from gpo.rollout_phases import Call, Phases, Round, RoundLedger, advance, generation_seed, rank_share
from gpo.run_config import TrainConfig
from gpo.sampler import QuestionStream
from gpo.step_math import score_groups
from gpo.types import (
    Allocator,
    Backend,
    Objective,
    Pruner,
    RolloutBatch,
    Sampling,
    Selector,
    Task,
    pass_criterion,
    passes,
)


@dataclass
class Rollout:
    """Everything a step's rollouts need, built once per run; `plan` starts one step's."""

    train: TrainConfig
    seed: int
    task: Task
    task_name: str
    tokenizer: Any
    backend: Backend
    objective: Objective
    selector: Selector
    pruner: Pruner
    allocator: Allocator
    questions: QuestionStream
    accelerator: Any
    policy: Any
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        T = self.train
        self.sampling = Sampling(max_new_tokens=T.max_completion_length, temperature=T.temperature, top_p=T.top_p)
        self.pass_key = pass_criterion(self.task)

    def plan(self, step: int, timer: PhaseTimer) -> StepRollout:
        return StepRollout(self, step, timer)

    def generate(self, examples: list, call: Call, timer: PhaseTimer, task_metrics: dict[str, float]) -> RolloutBatch:
        """This rank generates and scores its share of the call; every rank returns the call's whole batch."""
        share = rank_share(len(call.entries), self.rank, self.world_size)
        mine, counts = examples[share], call.counts[share]
        with timer("generate"), gathered(self.accelerator, self.policy, needed=self.backend.generates_with_policy):
            prompts = encode_prompts(self.tokenizer, [self.task.prompt(e) for e in mine], self.train.max_prompt_length)
            # Seeded by the call-wide index of this rank's first prompt (backends offset the seed per prompt), so
            # the step's samples do not depend on how many ranks share the generation.
            local = generate(
                # one count for a uniform call, even when this rank's share is empty: only a backend with
                # per_prompt_counts is ever given a list
                self.backend, prompts, call.counts[0] if call.uniform else counts, self.sampling,
                seed=call.seed + share.start, eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id, rank=self.rank,
            )
        with timer("reward"):
            ids = completion_tokens(local)
            texts = decode_completions(self.tokenizer, ids)
            rows_examples = [e for e, n in zip(mine, counts, strict=True) for _ in range(n)]
            scored = score_completions(self.task, self.task_name, texts, rows_examples, completion_ids=ids)
            local.rewards = torch.tensor(scored.total, dtype=torch.float32)  # [N_rank]
            local.reward_components = {k: torch.tensor(v, dtype=torch.float32) for k, v in scored.components.items()}
            for k, v in scored.metrics.items():  # counts such as verify_timeouts, summed over ranks and rounds
                key = f"reward/{k}"
                task_metrics[key] = task_metrics.get(key, 0.0) + float(all_reduce_sum(float(v)))
        return all_gather_batch(local, self.tokenizer.pad_token_id)


class StepRollout:
    """One step's rounds. Iterate for the finished whole-group batches; `record` each one's pruning before the next."""

    def __init__(self, rollout: Rollout, step: int, timer: PhaseTimer) -> None:
        self.r, self.step, self.timer = rollout, step, timer
        self.seen: list[RolloutBatch] = []  # every round's whole groups, before the group filter
        self.candidates: list[tuple[RolloutBatch, torch.Tensor]] = []  # the filter's groups, the pruner's mask
        self.kept_parts: list[RolloutBatch] = []
        self.spent = RoundLedger()
        self.task_metrics: dict[str, float] = {}
        self.task_rewards: list[torch.Tensor] = []  # [n] per finished batch, before the objective shapes them
        r = rollout
        self.phases = Phases(r.selector, lambda examples, call: r.generate(examples, call, timer, self.task_metrics),
                             r.train.group_size, r.tokenizer.pad_token_id, r.pass_key,
                             mixed=r.backend.per_prompt_counts)

    def __iter__(self) -> Iterator[tuple[RolloutBatch, torch.Tensor]]:
        r, T = self.r, self.r.train
        G, slots = T.group_size, T.questions_per_step * T.group_size
        kept_per_group, rate = r.pruner.expected_kept_per_group(G), self.pass_rate()
        # the allocator plans the first round; refills come back here while slots stay empty
        questions = r.allocator.first_round(slots, G, kept_per_group, r.world_size, pass_rate=rate)
        drawn, waiting = 0, None  # waiting: a round whose screened questions still need the rest of their groups
        while questions > 0 or waiting is not None:
            # the new round's first phase and the waiting round's second phase share the generation call(s)
            new = self._draw(questions, drawn) if questions > 0 else None
            drawn += new is not None
            finished, waiting, spent = advance(self.phases, waiting, new, self.step)
            self.spent = self.spent.add(spent)
            for batch in finished:  # shaped rewards and advantages over each whole group, and the group filter
                self.task_rewards.append(batch.rewards)  # scoring replaces them by the shaped total
                batch, group_keep = (batch, torch.zeros(0, dtype=torch.bool)) if len(batch) == 0 else score_groups(
                    r.objective, batch, G)
                self.seen.append(batch)
                yield batch, group_keep
            # A waiting round's rows are counted by the pruner's estimate; the allocator is asked again once known.
            slots_left = slots - sum(len(p) for p in self.kept_parts) - self._expected_rows(waiting, kept_per_group)
            questions = r.allocator.next_round(slots_left, drawn, G, kept_per_group, r.world_size,
                                               pass_rate=rate)

    def record(self, batch: RolloutBatch, keep: torch.Tensor) -> None:
        """The pruner's verdict on a finished batch (its filtered groups and the mask over them)."""
        self.candidates.append((batch, keep))
        self.kept_parts.append(batch.select(keep))

    def kept(self) -> RolloutBatch:
        """Every kept row of the step, in the order the rounds finished."""
        return RolloutBatch.concat(self.kept_parts, self.r.tokenizer.pad_token_id)

    def metrics(self) -> dict[str, float]:
        r = self.r
        out = {**rollout_metrics(self.seen, self.candidates, self.spent, r.train.group_size,
                                 r.tokenizer.pad_token_id), **self.task_metrics}
        # reward/mean is the objective's shaped total (DAPO's overlong penalty moves it); these two are comparable
        # across objectives
        task_rewards = torch.cat(self.task_rewards) if self.task_rewards else torch.zeros(0)
        out["reward/task_mean"] = float(task_rewards.mean()) if len(task_rewards) else float("nan")
        criterion = [b.reward_components[r.pass_key] for b in self.seen if r.pass_key in b.reward_components]
        if criterion:
            out["reward/success_rate"] = float(passes(torch.cat(criterion)).float().mean())
        return out

    def pass_rate(self) -> float:
        """The share of candidates the selector expects to reach a whole group (1 before it has an estimate): the
        dynamic allocator draws 1/rate times the candidates so the survivors fill the step."""
        rate = self.r.selector.expected_pass_rate()
        return 1.0 if rate is None else rate

    def _draw(self, n_questions: int, round_index: int) -> Round:
        """The round's candidates (the same questions, in the same order, on every rank) and the selector's
        first-phase counts for them."""
        r = self.r
        pool = r.questions.take_indices(n_questions)
        seed = generation_seed(r.seed, self.step, round_index)
        examples = [r.questions.examples[i] for i in pool]
        return Round(pool, examples, r.selector.first_phase(pool, r.train.group_size, seed=seed), seed)

    def _expected_rows(self, waiting: Round | None, kept_per_group: float | None) -> int:
        """Rows a round still generating its second phase is expected to add once pruned (a whole group per
        continued question where the pruner has no estimate)."""
        if waiting is None:
            return 0
        kept = self.r.train.group_size if kept_per_group is None else kept_per_group
        return math.ceil(waiting.continued * kept)
