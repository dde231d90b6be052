"""The data that flows through a training step, and the one interface per kind of component.

Symbols used everywhere: B questions, G completions per question (group size), N = B*G rows,
Lp prompt length, L completion length. The G rows of a question are contiguous and share `group_ids`.
The engine never branches on a component's name: it only calls the methods below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

import torch
from torch import Tensor

Messages = list[dict[str, str]]  # chat turns: [{"role": "system", "content": ...}, {"role": "user", ...}]
Example = dict[str, Any]  # one row of a task's data


@dataclass
class RolloutBatch:
    """Generated completions with their rewards and advantages; every tensor has N rows."""

    prompt_ids: Tensor  # [N, Lp] left-padded
    prompt_mask: Tensor  # [N, Lp] 1 on prompt tokens
    completion_ids: Tensor  # [N, L] right-padded
    # [N, L] 1 on the model's own tokens, up to and including its last EOS: what the loss, the lengths and every
    # token count read. A trajectory's tool results are not in it (see `tool_tokens`).
    completion_mask: Tensor
    group_ids: Tensor  # [N] long: the question each row answers (rows of a group are contiguous)
    rewards: Tensor  # [N] shaped total reward
    advantages: Tensor  # [N] computed over the full group, before any pruning
    truncated: Tensor  # [N] bool: generation hit max length without EOS
    owner_rank: Tensor  # [N] long: rank that generated the row (scope `rank` prunes within it)
    old_logprobs: Tensor | None = None  # [N, L] filled after pruning, only when needed
    ref_logprobs: Tensor | None = None  # [N, L]
    # [N, L] log pi_generator: the generator's log-probs of the tokens it sampled, from backends that report them
    # (Backend.generator_logprobs); None otherwise
    generator_logprobs: Tensor | None = None
    # The generator/trainer correction's, set by the engine once pi_old is known (gpo.step_math.corrected):
    is_weights: Tensor | None = None  # [N, L] per-token loss weights
    is_mask: Tensor | None = None  # bool [N, L] the token mask: tokens left in the loss; None: every one
    # bool/float [N, L]: the completion tokens the loss sees, the objective's `loss_mask(batch)` filled once per step
    # on its kept rows (gpo.step_math.with_loss_mask) so the step's totals, the correction and the loss read one
    # mask; a token outside it (padding, a truncated row DAPO masks, later a tool's output) is never trained on.
    # None: not filled yet, and a reader asks the objective (`loss_mask_of`)
    loss_mask: Tensor | None = None
    # [N] long: the policy version (optimizer steps taken) whose weights generated the row; a step's staleness
    # bound (train.max_staleness) is checked on it
    versions: Tensor | None = None
    reward_components: dict[str, Tensor] = field(default_factory=dict)  # name -> [N]
    # bool [N, L]: tokens a tool or an environment wrote into a multi-turn trajectory (gpo/agent.py). The model
    # attends to them but they are never trained, counted or given a KL term. None: a single-turn batch, no such
    # tokens (TRL's `tool_mask` is the complement: 1 on the model's tokens).
    tool_tokens: Tensor | None = None

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def lengths(self) -> Tensor:
        """[N]: the model's own tokens per row (tool results excluded)."""
        return self.completion_mask.sum(dim=1)

    @property
    def attended(self) -> Tensor:
        """[N, L] long: the completion's tokens the model reads, its own and the tools' (the attention mask of a
        log-prob pass); `completion_mask` itself where there are no tool tokens."""
        if self.tool_tokens is None:
            return self.completion_mask
        return self.completion_mask | self.tool_tokens.to(self.completion_mask.dtype)

    def counted(self, loss_mask: Tensor) -> Tensor:
        """bool [N, L]: the loss tokens that count, `loss_mask` less those the correction dropped (`is_mask`). The
        step's totals and the loss both read this, so a dropped token leaves every denominator."""
        m = loss_mask.bool()
        return m if self.is_mask is None else m & self.is_mask.to(m.device)

    def to(self, device: torch.device | str) -> RolloutBatch:
        def move(x: Any) -> Any:
            if isinstance(x, Tensor):
                return x.to(device)
            if isinstance(x, dict):
                return {k: v.to(device) for k, v in x.items()}
            return x

        return RolloutBatch(**{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def select(self, rows: Tensor) -> RolloutBatch:
        """The rows of a bool mask [N] or an index tensor (order preserved), with padding re-trimmed to the chosen
        rows' maximum."""
        rows = rows.nonzero(as_tuple=True)[0] if rows.dtype == torch.bool else rows

        def take(x: Any) -> Any:
            if isinstance(x, Tensor):
                return x[rows]
            if isinstance(x, dict):
                return {k: v[rows] for k, v in x.items()}
            return x

        out = RolloutBatch(**{f.name: take(getattr(self, f.name)) for f in dataclasses.fields(self)})
        return out.trimmed()

    def trimmed(self) -> RolloutBatch:
        """Drop completion columns that are padding in every row, and prompt columns likewise (left side)."""
        if len(self) == 0:
            return self
        attended = self.attended
        width = int(attended.sum(dim=0).nonzero().max().item()) + 1 if attended.any() else 1
        start = int(self.prompt_mask.sum(dim=0).nonzero().min().item()) if self.prompt_mask.any() else 0

        def cut(x: Tensor | None) -> Tensor | None:
            return None if x is None else x[:, :width]

        return dataclasses.replace(
            self,
            prompt_ids=self.prompt_ids[:, start:],
            prompt_mask=self.prompt_mask[:, start:],
            completion_ids=self.completion_ids[:, :width],
            completion_mask=self.completion_mask[:, :width],
            old_logprobs=cut(self.old_logprobs),
            ref_logprobs=cut(self.ref_logprobs),
            generator_logprobs=cut(self.generator_logprobs),
            is_weights=cut(self.is_weights),
            is_mask=cut(self.is_mask),
            loss_mask=cut(self.loss_mask),
            tool_tokens=cut(self.tool_tokens),
        )

    @staticmethod
    def concat(batches: Sequence[RolloutBatch], pad_token_id: int = 0) -> RolloutBatch:
        """Stack batches row-wise (refill rounds); group ids stay distinct, shorter tensors are padded."""
        batches = [b for b in batches if len(b) > 0] or list(batches[:1])
        if len(batches) == 1:
            return batches[0]
        offset, group_ids = 0, []
        for b in batches:
            group_ids.append(b.group_ids + offset)
            offset += int(b.group_ids.max().item()) + 1 if len(b) else 0

        def stack(parts: list[Tensor], left: bool = False, pad: float = 0) -> Tensor:
            if parts[0].dim() == 1:
                return torch.cat(parts)
            width = max(p.shape[1] for p in parts)
            padded = []
            for p in parts:
                extra = width - p.shape[1]
                padded.append(torch.nn.functional.pad(p, (extra, 0) if left else (0, extra), value=pad))
            return torch.cat(padded)

        def cat(name: str, left: bool = False, pad: float = 0) -> Tensor:
            return stack([getattr(b, name) for b in batches], left, pad)

        def cat_optional(name: str) -> Tensor | None:  # None unless every batch has the field
            parts = [getattr(b, name) for b in batches]
            return None if any(p is None for p in parts) else stack(parts)

        return RolloutBatch(
            prompt_ids=cat("prompt_ids", left=True, pad=pad_token_id),
            prompt_mask=cat("prompt_mask", left=True),
            completion_ids=cat("completion_ids", pad=pad_token_id),
            completion_mask=cat("completion_mask"),
            group_ids=torch.cat(group_ids),
            rewards=cat("rewards"),
            advantages=cat("advantages"),
            truncated=cat("truncated"),
            owner_rank=cat("owner_rank"),
            old_logprobs=cat_optional("old_logprobs"),
            ref_logprobs=cat_optional("ref_logprobs"),
            generator_logprobs=cat_optional("generator_logprobs"),
            is_weights=cat_optional("is_weights"),
            is_mask=cat_optional("is_mask"),
            loss_mask=cat_optional("loss_mask"),
            versions=cat_optional("versions"),
            tool_tokens=None if all(b.tool_tokens is None for b in batches) else stack(
                [torch.zeros_like(b.completion_ids, dtype=torch.bool) if b.tool_tokens is None else b.tool_tokens
                 for b in batches]),
            reward_components={
                k: torch.cat([b.reward_components[k] for b in batches]) for k in batches[0].reward_components
            },
        )


@dataclass(frozen=True)
class StepTotals:
    """Counts over the rows trained in one optimizer step, summed over micro-batches and ranks.

    Objectives divide by these, so a loss does not change with the micro-batch size or the number of ranks.
    """

    sequences: int
    tokens: int


@dataclass(frozen=True)
class Corrected:
    """What a correction returns for rows of [n, L] tokens. Outside the loss mask: weight 1, in the token mask, not
    truncated. The engine carries `weights` and `mask` in the batch as `RolloutBatch.is_weights` and `is_mask`."""

    weights: Tensor  # [n, L] per-token loss weights, 0 where dropped; no gradient
    mask: Tensor  # bool [n, L]: the token mask, tokens left in the loss (and in its denominators)
    truncated: Tensor  # bool [n, L]: tokens left in the loss whose weight was capped


@dataclass
class Rewards:
    """What a task's `reward` returns for N completions."""

    total: list[float]  # weighted sum of the components
    components: dict[str, list[float]]  # e.g. {"format": [...], "accuracy": [...]}
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. {"verify_timeouts": 1}


@dataclass(frozen=True)
class QuestionRewards:
    """One question's rewards so far, in row order (screening rows first): what selectors decide on.

    `passed` reads the task's pass criterion (its `accuracy` component unless the task names another) through
    `passes`: 1 right, 0 wrong; None when the task has no such component, and then a selector can only judge on
    `total`."""

    total: Tensor  # [n] shaped total reward
    passed: Tensor | None  # [n] float 0/1
    components: dict[str, Tensor] = field(default_factory=dict)  # [n] each, every reward component by name

    def __len__(self) -> int:
        return int(self.total.numel())


@dataclass
class Grade:
    """How one completion was judged, for evaluation reports."""

    extracted: str | None  # the answer read from the completion, None if there was none
    gold: str
    correct: bool
    formatted: bool


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


# --- the interface of each kind ---------------------------------------------------------------------------------


class Objective(Protocol):
    """algo: turns rewards into advantages and log-probs into a loss."""

    # False when the KL coefficient is 0: no reference model is loaded at all. (Old log-probs are the engine's
    # decision: it computes them when train.mu > 1, else the loss uses the detached current ones.)
    needs_ref_logprobs: bool

    def shape_rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
        """[B, G] -> [B, G], e.g. DAPO's soft overlong penalty. Identity by default."""

    def group_filter(self, rewards: Tensor, components: dict[str, Tensor], passed: Tensor | None = None) -> Tensor:
        """Shaped rewards [B, G] and the task's raw reward components (name -> [B, G], e.g. "accuracy", "format")
        -> bool [B]: the groups the objective trains on (DAPO's dynamic sampling drops groups whose completions all
        pass or all fail). `passed` (bool [B, G]) is each completion's verdict by the task's pass criterion
        (`passes`), whatever component the task names; the step always gives it when the task reports that
        component. A caller without it (None) leaves the objective to read the `accuracy` component."""

    def advantages(self, rewards: Tensor) -> Tensor:
        """[B, G] -> [B, G]."""

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        """[N, L]: tokens that count in the loss (completion_mask, minus rows the objective masks, e.g. truncated).

        Called once per step, on the step's kept rows: its result becomes `RolloutBatch.loss_mask`, which the step's
        `StepTotals`, the correction and `loss` all read (`loss_mask_of`). It must decide each row from that row
        alone, so the mask of a micro-batch is the step's mask of those rows.
        """

    def loss(self, logp: Tensor, batch: RolloutBatch, totals: StepTotals) -> tuple[Tensor, dict[str, Tensor]]:
        """This micro-batch's share of the step loss (the engine sums the shares) and detached metrics, over the
        tokens of `loss_mask_of(self, batch)` (the batch's filled `loss_mask`)."""


def loss_mask_of(objective: Objective, batch: RolloutBatch) -> Tensor:
    """[N, L]: the tokens the loss sees, `batch.loss_mask` where the step filled it, else the objective's
    `loss_mask(batch)` (a hand-made batch): what every reader of the loss mask calls."""
    return model_tokens_only(objective.loss_mask(batch), batch) if batch.loss_mask is None else batch.loss_mask


def model_tokens_only(mask: Tensor, batch: RolloutBatch) -> Tensor:
    """`mask` [N, L] without the tokens a tool or environment wrote: whatever an objective's `loss_mask` returns
    (a plug-in's may start from all ones), they are never trained on."""
    if batch.tool_tokens is None:
        return mask
    return mask * ~batch.tool_tokens.to(mask.device) if mask.dtype != torch.bool else mask & ~batch.tool_tokens


class Pruner(Protocol):
    """pruner: which completions are worth a forward pass. Pure; never changes advantages."""

    def keep(self, batch: RolloutBatch, multiple_of: int = 1) -> Tensor:
        """bool [N], decided on the whole (gathered) step, identically on every rank.

        The kept count is a multiple of `multiple_of` (the engine passes the world size, so every rank trains as
        many rows): the pruner adds rows its rule left out by its own score (topk and threshold the largest |A|,
        random its random priorities). When too few rows are left out for that (N itself is not a multiple) the
        count stays uneven and the engine's shard() reports it.
        """

    def expected_kept_per_group(self, group_size: int) -> float | None:
        """Completions kept per question on average, if known up front (used by the dynamic allocator)."""


class Allocator(Protocol):
    """allocator: how many questions a step draws, and refills when filtering or pruning leaves slots empty."""

    def first_round(self, slots: int, group_size: int, kept_per_group: float | None, world_size: int,
                    pass_rate: float = 1.0) -> int:
        """Questions to draw first, for `slots` = B*G training rows. `kept_per_group` is the pruner's estimate of
        rows kept per whole group (None: none), `pass_rate` the selector's pass rate, the share of candidates
        expected to reach a whole group (`Selector.expected_pass_rate`), in (0, 1]."""

    def next_round(self, slots_left: int, rounds_done: int, group_size: int, kept_per_group: float | None,
                   world_size: int, pass_rate: float = 1.0) -> int:
        """Questions to draw in another round; 0 stops. Asked after every round; while a round is still
        generating its second phase, `slots_left` counts its continued groups by the pruner's estimate, and the
        engine asks again (same `rounds_done`) once they are known, so an answer of 0 need not be the last call."""

    def metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Selector(Protocol):
    """selector: before generation, which of a round's candidate questions get rollouts, and in which phases.

    Candidates are named by their index in the task's train pool (stable across epochs, ranks and resumes). The
    engine asks `first_phase`, generates and scores what it says, then asks `continue_after` about every question
    that got fewer than G completions; those it continues get the remaining completions, the rest are screened out
    (their rollouts are counted, never trained on). `observe` then sees every candidate's rewards.
    Rewards come as one `QuestionRewards` per question: the total (the task's weighted sum of its components, before
    any objective's shaping), every component, and the task's pass criterion (`passed`), which is what the built-in
    selectors judge by default (selection/base.py).
    Decisions depend only on the selector's state, the arguments and `seed`, so every rank, given the same
    all-gathered rewards, decides the same. The state (per-question history) is saved in the checkpoint as JSON:
    `state_dict` must survive `json.loads(json.dumps(...))` (dict keys come back as strings) and a selector loaded
    from it must decide as the original would.
    """

    def first_phase(self, questions: list[int], group_size: int, seed: int) -> list[int]:
        """Completions to generate now per candidate: 0 skips it, group_size generates its whole group, anything
        between screens it first."""

    def continue_after(self, questions: list[int], rewards: list[QuestionRewards], group_size: int) -> list[bool]:
        """For each question that got fewer than G completions, its rewards so far (screening rows, [n] each):
        continue it to G?"""

    def observe(self, questions: list[int], rewards: list[QuestionRewards], step: int) -> None:
        """Every candidate of the round, in the order `first_phase` was given them, with all its generated rows
        (screening rows first). A skipped candidate (0 completions) comes with an empty record (len 0): it is
        passed, not left out, so a selector can tell "drawn and skipped" from "not drawn"."""

    def expected_pass_rate(self) -> float | None:
        """The share of candidates expected to pass selection, i.e. reach a whole group (None: no estimate yet); the
        engine scales the pruner's kept-per-group by it, so the dynamic allocator draws enough candidates to fill
        the step."""

    def metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Correction(Protocol):
    """correction: weights and masks for the mismatch between the generator's and the trainer's log-probs.

    Applied only to batches whose backend reports the generator's log-probs. Pure: the same inputs give the same
    result on every rank."""

    # True when `correct` may drop tokens: the engine then computes pi_old (a no-grad pass) before it counts the
    # step's loss tokens. False: the returned `mask` is all true, and with train.mu == 1 pi_old is the training
    # pass's own detached log-probs.
    masks: bool

    def correct(self, old_logprobs: Tensor, generator_logprobs: Tensor, loss_mask: Tensor) -> Corrected:
        """pi_old's log-probs [n, L] (the trainer's, no gradient), the generator's [n, L] (log pi_generator) and the
        objective's loss mask [n, L] -> per-token weights, the token mask (tokens left in the loss) and the
        truncated tokens."""


class Task(Protocol):
    """task: data, prompts, rewards and grading for one benchmark."""

    def load(self, split: str) -> Sequence[Example]: ...

    def prompt(self, example: Example) -> Messages: ...

    def reward(self, completions: list[str], examples: list[Example]) -> Rewards: ...

    def grade(self, completions: list[str], examples: list[Example]) -> list[Grade]: ...

    def close(self) -> None:
        """Free what the task holds outside Python (e.g. math's verification workers); a no-op where it holds
        nothing. Safe to call twice; a task used after close() starts what it needs again."""


def pass_criterion(task: Any) -> str:
    """The reward component that says whether a completion is right (see `passes`): a task's `pass_criterion`
    attribute (the built-in tasks declare "accuracy"; `task=dataset` may name one of the user's rewards)."""
    return getattr(task, "pass_criterion", "accuracy")


# A completion passes when its pass-criterion component is above this. 0: any positive score is right (GSM8K's
# accuracy is 2 for the exact answer, 1.5 for an equal number, 0 when wrong: both positive scores pass).
PASS_THRESHOLD = 0.0


@overload
def passes(criterion: Tensor, threshold: float = PASS_THRESHOLD) -> Tensor: ...


@overload
def passes(criterion: float, threshold: float = PASS_THRESHOLD) -> bool: ...


def passes(criterion: Tensor | float, threshold: float = PASS_THRESHOLD) -> Tensor | bool:
    """The one rule for "right": a completion passes when its pass-criterion component is > `threshold`.

    bool [n] for a tensor of scores, a bool for one score. Everything that decides "right" calls it: DAPO's group
    filter (through the step), the selectors (`QuestionRewards.passed`), a step's `reward/success_rate`, and the
    tasks' `grade`, hence evaluation's accuracy, pass@k and maj@n."""
    if isinstance(criterion, Tensor):
        return criterion > threshold
    return bool(criterion > threshold)


class Backend(Protocol):
    """backend: generates completions; the policy's weights are synced into it after every optimizer step."""

    # True when `generate` runs the training model itself (`hf`): under ZeRO-3 its parameters must then be gathered
    # around generation. False for a generator with its own copy of the weights (`vllm`), which gets them through
    # `sync_weights` and needs nothing gathered while it generates.
    generates_with_policy: bool
    # True when `generate` takes a completion count per prompt (a list n); False: one count per call, so the rollout
    # groups prompts with equal counts into separate calls.
    per_prompt_counts: bool

    def generate(self, prompts: list[list[int]], n: int | list[int], sampling: Sampling,
                 seed: int) -> list[list[int]]:
        """Token ids of n completions per prompt, prompt-major (row i*n + j is prompt i's j-th sample). Only a
        backend that declares `per_prompt_counts = True` is given a list, n[i] completions for prompt i; the
        engine then generates a round's second phase and the next round's first phase in one call."""

    def generator_logprobs(self) -> list[list[float]] | None:
        """log pi_generator: the generator's log-prob of each token the last `generate` returned (same layout), log
        softmax(logits / temperature) before top-p truncation, as the trainer computes it. None when it reports none
        (a greedy call)."""

    def sync_weights(self, model: Any) -> None: ...

    def close(self) -> None:
        """Free the generator's resources (vLLM's engine, which must shut down before the trainer's process group
        does); a no-op where there is nothing to free. Safe to call twice."""


class Tracker(Protocol):
    """tracker: where params, metrics and artifacts go. Only rank 0 holds a real one."""

    def start(self, run_name: str, params: dict[str, Any], config_yaml: str) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: str) -> None: ...

    def log_summary(self, metrics: dict[str, Any]) -> None:
        """Final results of the run (e.g. final accuracy, path of the saved model)."""

    def end(self, status: str = "FINISHED") -> None: ...

    def location(self) -> str:
        """A human line: where the run is logged and how to open it."""
