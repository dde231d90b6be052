"""The objective's loss mask is computed once per step (`RolloutBatch.loss_mask`, filled by
`gpo.step_math.with_loss_mask`): the step's totals, the correction and every micro-batch's loss read that field, and
the result is bit for bit what asking the objective for each piece gave."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpo import registry
from gpo.distributed import all_gather_batch, shard
from gpo.logprobs import micro_batches
from gpo.step_math import corrected, loss_shares, step_totals, with_loss_mask
from gpo.types import RolloutBatch, StepTotals

registry.load_builtins()

WIDTH = 5
LENGTHS = [5, 2, 3, 5, 1, 4]  # completion tokens per row; rows 0 and 3 hit the maximum length (truncated)


def counting(name: str, **cfg):
    """The registered objective `name`, built from `cfg` as a run builds it, through a subclass that counts its
    `loss_mask` calls in `.calls`."""
    entry = registry.get("algo", name)

    class Counted(entry.cls):  # type: ignore[misc, name-defined]
        calls = 0

        def loss_mask(self, batch):
            type(self).calls += 1
            return super().loss_mask(batch)

    return dataclasses.replace(entry, cls=Counted).build(cfg, max_completion_length=WIDTH)


def hand_batch(seed: int = 0, generator_logprobs: bool = False) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    n = len(LENGTHS)
    mask = (torch.arange(WIDTH) < torch.tensor(LENGTHS).unsqueeze(1)).long()  # [N, L]
    old = -torch.rand(n, WIDTH, generator=gen) - 0.1  # [N, L]
    return RolloutBatch(
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        completion_ids=(torch.arange(n * WIDTH).reshape(n, WIDTH) % 40 + 3) * mask,
        completion_mask=mask,
        group_ids=torch.arange(n) // 3,
        rewards=torch.rand(n, generator=gen),
        advantages=torch.randn(n, generator=gen),
        truncated=torch.tensor([k == WIDTH for k in LENGTHS]),
        owner_rank=torch.zeros(n, dtype=torch.long),
        old_logprobs=old,
        generator_logprobs=(old + 0.05 * torch.randn(n, WIDTH, generator=gen)) if generator_logprobs else None,
    )


@pytest.mark.parametrize("algo, cfg", [("grpo", {"beta": 0.0}), ("dapo", {"mask_truncated": True}),
                                       ("dr_grpo", {"beta": 0.0})])
def test_loss_shares_ask_the_objective_once_and_match_asking_it_per_micro_batch(algo, cfg):
    objective = counting(algo, **cfg)
    batch = hand_batch()
    logp = batch.old_logprobs + 0.2 * torch.randn(len(batch), WIDTH, generator=torch.Generator().manual_seed(1))

    # Asked per piece, as a hand-made batch without the field still is: once for the totals, once per micro-batch.
    mask = objective.loss_mask(batch).bool()
    totals = StepTotals(sequences=len(batch), tokens=int(mask.sum()))
    per_piece, row = [], 0
    for mb in micro_batches(batch, 2):
        per_piece.append(objective.loss(logp[row:row + len(mb), :mb.completion_ids.shape[1]], mb, totals))
        row += len(mb)
    assert type(objective).calls == 1 + 3

    type(objective).calls = 0
    shares = loss_shares(objective, batch, logp, micro_batch_size=2)
    assert type(objective).calls == 1
    assert len(shares) == len(per_piece) == 3
    for (loss, metrics), (expected, expected_metrics) in zip(shares, per_piece, strict=True):
        assert torch.equal(loss, expected)
        assert metrics.keys() == expected_metrics.keys()
        assert all(torch.equal(metrics[k], expected_metrics[k]) for k in metrics)


def test_the_totals_and_the_correction_read_the_filled_mask():
    objective = counting("dapo", mask_truncated=True)
    batch = with_loss_mask(objective, hand_batch(generator_logprobs=True))
    assert type(objective).calls == 1
    assert torch.equal(batch.loss_mask, objective.loss_mask(batch))  # the objective's own answer (a second call)
    type(objective).calls = 0
    correction = registry.get("correction", "icepop").build({})
    fixed, counts = corrected(correction, objective, batch, batch.old_logprobs)
    totals = step_totals(objective, fixed)
    assert with_loss_mask(objective, fixed) is fixed  # filled already: returned as it is
    assert type(objective).calls == 0
    # DAPO masks the two truncated rows: their tokens are in neither the counts nor the totals
    loss_tokens = sum(k for k in LENGTHS if k < WIDTH)
    assert counts["tokens"] == loss_tokens
    assert totals.tokens == counts["left"]  # the tokens the correction left in that same mask
    assert totals.sequences == len(batch)


def test_the_filled_mask_travels_with_the_rows():
    objective = registry.get("algo", "dapo").build({"mask_truncated": True}, max_completion_length=WIDTH)
    batch = with_loss_mask(objective, hand_batch())
    full = batch.loss_mask
    assert full.shape == (len(batch), WIDTH) and full.sum() == sum(k for k in LENGTHS if k < WIDTH)

    def same_rows(piece: RolloutBatch, rows: list[int]) -> bool:
        width = piece.completion_mask.shape[1]  # pieces are re-trimmed to their longest completion
        return piece.loss_mask is not None and torch.equal(piece.loss_mask, full[rows, :width])

    assert same_rows(batch.select(torch.tensor([1, 2, 4])), [1, 2, 4])
    assert same_rows(batch.select(torch.tensor([False, True, False, False, True, False])), [1, 4])
    assert same_rows(batch.to("cpu"), list(range(len(batch))))
    assert same_rows(all_gather_batch(batch, pad_token_id=0), list(range(len(batch))))  # one process: as it is
    assert same_rows(shard(batch, rank=1, world_size=2), [3, 4, 5])
    pieces = list(micro_batches(batch, 4))
    assert same_rows(pieces[0], [0, 1, 2, 3]) and same_rows(pieces[1], [4, 5])
    joined = RolloutBatch.concat([batch.select(torch.tensor([1, 4])), batch.select(torch.tensor([0]))])
    assert torch.equal(joined.loss_mask, full[[1, 4, 0]])
    # a piece of a batch without the field has none: readers then ask the objective
    assert RolloutBatch.concat([dataclasses.replace(batch, loss_mask=None), batch]).loss_mask is None


def test_an_engine_step_asks_the_objective_once(tiny_model_path, tmp_path, monkeypatch):
    """A tiny step through the engine: two optimizer passes over micro-batches of one row, with the generator's
    log-probs corrected (the default correction), then one pass with the correction on each micro-batch: one
    `loss_mask` call per step either way."""
    from gpo.config import compose
    from gpo.engine import Engine

    engine = Engine(compose([f"model.path={tiny_model_path}", "tracker=none", f"output_dir={tmp_path}",
                             "train.group_size=4", "train.questions_per_step=1", "train.max_completion_length=4",
                             "train.micro_batch_size=1", "train.mu=2", "allocator=static", "pruner=topk",
                             "pruner.rate=0.5", "eval.before_and_after=false"]))
    calls = []
    ask = engine.objective.loss_mask
    monkeypatch.setattr(engine.objective, "loss_mask", lambda batch: calls.append(len(batch)) or ask(batch))
    metrics = engine.step()
    assert metrics["train/rows"] == 2 and metrics.get("train/skipped", 0.0) == 0.0
    assert any(k.startswith("mismatch/") for k in metrics), "the correction ran on this step"
    assert calls == [2]  # once, on the step's two kept rows, not once per micro-batch and pass
    calls.clear()
    engine.train_cfg = dataclasses.replace(engine.train_cfg, mu=1)  # the correction moves into each micro-batch
    metrics = engine.step()
    assert any(k.startswith("mismatch/") for k in metrics)
    assert calls == [2]
