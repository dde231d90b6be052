"""The engine on a tiny random model: every algo x pruner x allocator trains, on exactly the kept rows."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from gpo import registry
from kit import RowCounter, tiny_config

PAPER_ALGO = "grpo"  # CPPO's objective: with it, every pruner x allocator combination runs


def combinations() -> list[tuple[str, str, str]]:
    """Every algo x pruner pair, each with one allocator, taken in turn so that every algo and every pruner also runs
    with every allocator (all pairs of values appear: the allocator only sets how many questions a step draws, the
    rows that follow are the pruner's and the objective's), plus every allocator for the paper's objective.
    Half of the full product (72 engines, about two minutes of the suite on 2 cores) with every pair still tried."""
    registry.load_builtins()
    algos, pruners, allocators = (registry.names(kind) for kind in ("algo", "pruner", "allocator"))
    return [(a, p, al) for i, a in enumerate(algos) for j, p in enumerate(pruners)
            for k, al in enumerate(allocators) if a == PAPER_ALGO or (i + j) % len(allocators) == k]


def test_the_combinations_try_every_pair_of_components():
    registry.load_builtins()
    chosen = combinations()
    kinds = ("algo", "pruner", "allocator")
    names = [registry.names(kind) for kind in kinds]
    for x, y in itertools.combinations(range(len(kinds)), 2):
        assert {(c[x], c[y]) for c in chosen} == set(itertools.product(names[x], names[y])), (kinds[x], kinds[y])
    assert {c for c in chosen if c[0] == PAPER_ALGO} == set(itertools.product([PAPER_ALGO], names[1], names[2]))
    assert len(set(chosen)) == len(chosen) < len(list(itertools.product(*names)))


@pytest.mark.parametrize("algo,pruner,allocator", combinations())
def test_every_combination_trains_on_exactly_the_kept_rows(algo, pruner, allocator, tiny_model_path, tmp_path,
                                                           monkeypatch):
    from gpo.engine import Engine

    extra = [f"algo={algo}", f"pruner={pruner}", f"allocator={allocator}"]
    if pruner == "threshold":
        extra.append("pruner.gamma=0.05")  # Dr.GRPO advantages are unscaled reward gaps (~0.1 here)
    engine = Engine(tiny_config(tiny_model_path, tmp_path, *extra))
    before = [p.detach().clone() for p in engine.policy.parameters()]
    counter = RowCounter(monkeypatch)
    for _ in range(2):
        counter.rows.clear()
        metrics = engine.step()
        assert math.isfinite(metrics.get("loss/total", 0.0))
        kept = int(metrics.get("train/rows", 0))
        assert kept == round(metrics["prune/kept_frac"] * metrics["alloc/questions"] * 4 *
                             metrics.get("filter/kept_groups_frac", 1.0))
        passes = 1 + (engine.train_cfg.mu > 1) + engine.objective.needs_ref_logprobs
        assert sum(counter.rows) == kept * passes * engine.train_cfg.mu if kept else sum(counter.rows) == 0
    changed = any(not torch.equal(b, p) for b, p in zip(before, engine.policy.parameters()))
    assert changed, "two steps with lr 1e-2 on non-zero advantages must move the parameters"


def test_reference_model_exists_only_when_the_objective_needs_it(tiny_model_path, tmp_path):
    from gpo.engine import Engine

    with_kl = Engine(tiny_config(tiny_model_path, tmp_path, "algo=grpo", "algo.beta=0.04"))
    without = Engine(tiny_config(tiny_model_path, tmp_path, "algo=grpo", "algo.beta=0"))
    assert with_kl.ref is not None and without.ref is None


def test_mu_two_computes_old_logprobs_and_steps_twice(tiny_model_path, tmp_path, monkeypatch):
    from gpo.engine import Engine

    engine = Engine(tiny_config(tiny_model_path, tmp_path, "algo=grpo", "algo.beta=0", "train.mu=2",
                                "pruner=none", "allocator=static"))
    counter = RowCounter(monkeypatch)
    metrics = engine.step()
    rows = int(metrics["train/rows"])
    assert sum(counter.rows) == rows * 3  # one old-policy pass + two training passes
    assert engine.optimizer.state_dict()["state"][0]["step"] == 2


def test_fused_adamw_is_the_default_and_trains_like_the_per_tensor_loop(tiny_model_path, tmp_path):
    from gpo.engine import Engine

    fused = Engine(tiny_config(tiny_model_path, tmp_path / "a", "pruner=none", "allocator=static"))
    looped = Engine(tiny_config(tiny_model_path, tmp_path / "b", "pruner=none", "allocator=static",
                                "optim.fused=false"))
    assert fused.optimizer.defaults["fused"] and not looped.optimizer.defaults["fused"]
    start = [p.detach().clone() for p in fused.policy.parameters()]
    for engine in (fused, looped):
        for _ in range(2):
            engine.step()
    moved = max((p.detach() - s).abs().max().item() for p, s in zip(fused.policy.parameters(), start))
    gap = max((a.detach() - b.detach()).abs().max().item()
              for a, b in zip(fused.policy.parameters(), looped.policy.parameters()))
    # Same seeds, samples and AdamW maths; the kernels only round differently (measured gap 2.5e-6).
    assert moved > 1e-3 and gap < 1e-5, (moved, gap)


def test_shared_prompt_steps_train_like_full_passes(tiny_model_path, tmp_path):
    """Two GRPO steps with mu=2 (old-policy pass), beta>0 (reference pass): the same losses, gradients and weights.

    Step by step, since AdamW divides by sqrt(v): where v is tiny, rounding-level gradient differences become
    visible update differences, and a second step on those weights amplifies them further. How far depends on the
    CPU's kernels (a few 1e-5 on the CPUs tried). The bound is 1% of one AdamW update (lr 1e-2): a real difference
    in the shared path (a wrong prompt row, a missing mask) moves weights by the order of lr itself, and shows in
    the losses first.
    """
    from gpo.engine import Engine

    extra = ("pruner=none", "allocator=static", "train.mu=2", "algo.beta=0.04")
    shared = Engine(tiny_config(tiny_model_path, tmp_path / "a", *extra))
    full = Engine(tiny_config(tiny_model_path, tmp_path / "b", *extra, "train.share_prompt=false"))
    assert shared.module.share_prompt and shared.ref.share_prompt and not full.module.share_prompt
    start = [p.detach().clone() for p in shared.policy.parameters()]
    for step in range(2):
        a, b = shared.step(), full.step()
        for key in ("loss/total", "train/grad_norm", "kl/mean", "tokens/trained"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (step, key)
        gap = max((x.detach() - y.detach()).abs().max().item()
                  for x, y in zip(shared.policy.parameters(), full.policy.parameters()))
        assert gap < 1e-4, (step, gap)
    moved = max((p.detach() - s).abs().max().item() for p, s in zip(shared.policy.parameters(), start))
    assert moved > 1e-3
    assert a["kl/mean"] > 0  # the reference pass ran and the policy has moved away from it


def test_lora_trains_only_the_adapter_and_saves_a_merged_model(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from gpo.engine import Engine

    engine = Engine(tiny_config(tiny_model_path, tmp_path, "algo=grpo", "algo.beta=0.04", "model.lora_rank=4",
                                "model.gradient_checkpointing=true"))
    trainable = {n: p.detach().clone() for n, p in engine.policy.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in engine.policy.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    engine.step()
    engine.step()
    now = dict(engine.policy.named_parameters())
    assert any(not torch.equal(now[n], p) for n, p in trainable.items())
    assert all(torch.equal(now[n], p) for n, p in frozen.items())
    merged = AutoModelForCausalLM.from_pretrained(engine.save_model("best"))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    # Saving mid-run (best checkpoint) must leave the adapter in place so training continues.
    assert any(p.requires_grad and "lora_" in n for n, p in engine.policy.named_parameters())
    engine.step()


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_lower_precision_generator_trains_and_is_synced_every_step(tiny_model_path, tmp_path, precision):
    """Two steps sampling from a bf16 / int8 copy: each step logs the refresh's seconds, and after the last the copy
    holds the trained weights (bf16: equal after the cast; int8: the norms, kept in float32, equal)."""
    from gpo.engine import Engine
    from gpo.models import plain_weights

    engine = Engine(tiny_config(tiny_model_path, tmp_path, "backend=hf", f"backend.precision={precision}",
                                "pruner=none", "allocator=static"))
    start = {n: t.clone() for n, t in plain_weights(engine.policy)}
    steps = [engine.step() for _ in range(2)]
    assert all(m["time/weight_sync"] > 0 and m["tokens/trained"] > 0 for m in steps)
    trained = dict(plain_weights(engine.policy))
    copy = dict(engine.backend.generator().named_parameters())
    norm = "model.norm.weight"
    assert not torch.equal(trained[norm], start[norm])
    assert torch.equal(copy[norm], trained[norm].to(copy[norm].dtype))


def test_policy_entropy_is_a_token_weighted_mean_whatever_the_micro_batches(tiny_model_path, tmp_path):
    """One micro-batch per row against one for the whole step: a mean of per-micro-batch means would differ (rows
    have different lengths); the token-weighted mean does not."""
    import math

    from gpo.engine import Engine

    extra = ("pruner=none", "allocator=static")
    whole = Engine(tiny_config(tiny_model_path, tmp_path / "a", *extra, "train.micro_batch_size=64"))
    rows = Engine(tiny_config(tiny_model_path, tmp_path / "b", *extra, "train.micro_batch_size=1"))
    a, b = whole.step(), rows.step()
    assert a["tokens/trained"] == b["tokens/trained"] > 0
    vocab = whole.policy.get_output_embeddings().weight.shape[0]
    assert 0 < a["policy/entropy"] <= math.log(vocab)
    assert a["policy/entropy"] == pytest.approx(b["policy/entropy"], rel=1e-4)
