"""The generator/trainer correction inside the engine, on a tiny model whose backend reports log-probs: the mismatch
metrics are logged whatever the correction (`none` too), a masking correction gets its pi_old pass and takes the
dropped tokens out of the step's token count, a weighting one needs no extra pass with train.mu == 1."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kit import RowCounter, tiny_config

QUICK = ["algo=grpo", "algo.beta=0", "pruner=none", "allocator=static"]


def report_logprobs(engine, monkeypatch: pytest.MonkeyPatch, perturb: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make the engine's backend report, for every token it sampled, the policy's own log-prob changed by
    `perturb` (one row's [len] tensor in, [len] out), as a generator with its own copy of the weights would."""
    backend, model = engine.backend, engine.policy
    generate, reported = backend.generate, []

    def generating(prompts, n, sampling, seed):
        completions = generate(prompts, n, sampling, seed)
        counts = n if isinstance(n, list) else [n] * len(prompts)
        rows = [prompt for prompt, count in zip(prompts, counts) for _ in range(count)]
        reported.clear()
        for prompt, completion in zip(rows, completions):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
            logp = logits.log_softmax(-1).gather(1, torch.tensor(completion).view(-1, 1)).view(-1)  # [len]
            reported.append(perturb(logp).tolist())
        return completions

    monkeypatch.setattr(backend, "generate", generating)
    monkeypatch.setattr(backend, "generator_logprobs", lambda: list(reported))


def test_none_still_logs_the_mismatch_and_adds_no_pass(tiny_model_path, tmp_path, monkeypatch):
    from gpo.engine import Engine

    engine = Engine(tiny_config(tiny_model_path, tmp_path, *QUICK, "correction=none"))
    report_logprobs(engine, monkeypatch, lambda logp: logp + 0.25)  # the generator is 0.25 nats more confident
    counter = RowCounter(monkeypatch)
    metrics = engine.step()
    assert sum(counter.rows) == metrics["train/rows"]  # the training pass only: pi_old is its own, detached
    # d = log pi_old - log pi_generator = -0.25 on every token (up to the two forwards' float32 rounding)
    assert metrics["mismatch/logp_abs_mean"] == pytest.approx(0.25, abs=1e-3)
    assert metrics["mismatch/logp_abs_max"] == pytest.approx(0.25, abs=1e-3)
    # k3 = exp(d) - 1 - d = e^-0.25 - 0.75 = 0.02880
    assert metrics["mismatch/kl_gen_train"] == pytest.approx(0.0288008, abs=1e-3)
    assert metrics["correction/weight_mean"] == 1.0 and metrics["correction/masked_frac"] == 0.0


def test_icepop_drops_tokens_from_the_step_after_a_pi_old_pass(tiny_model_path, tmp_path, monkeypatch):
    from gpo.engine import Engine

    engine = Engine(tiny_config(tiny_model_path, tmp_path, *QUICK, "correction=icepop"))

    def first_token_off(logp):  # pi_old / pi_generator = e^2 = 7.4 > 5 on each row's first token: icepop drops it
        return torch.cat([logp[:1] - 2.0, logp[1:]])

    report_logprobs(engine, monkeypatch, first_token_off)
    counter = RowCounter(monkeypatch)
    metrics = engine.step()
    rows = metrics["train/rows"]
    assert sum(counter.rows) == 2 * rows  # the pi_old pass, then the training pass
    assert metrics["correction/masked_seq_frac"] == 1.0  # one token of every row
    loss_tokens = rows / metrics["correction/masked_frac"]  # masked_frac = rows / loss tokens
    assert metrics["tokens/trained"] == pytest.approx(loss_tokens - rows)  # the dropped tokens left the count
    assert metrics["mismatch/logp_abs_max"] == pytest.approx(2.0, abs=1e-3)


def test_tis_with_mu_two_weighs_from_the_old_pass(tiny_model_path, tmp_path, monkeypatch):
    from gpo.engine import Engine

    engine = Engine(tiny_config(tiny_model_path, tmp_path, *QUICK, "train.mu=2", "correction=tis",
                                "correction.cap=1.1"))
    report_logprobs(engine, monkeypatch, lambda logp: logp - 0.5)  # pi_old / pi_generator = e^0.5 = 1.65 > 1.1
    metrics = engine.step()
    assert metrics["correction/truncated_frac"] == 1.0 and metrics["correction/weight_mean"] == pytest.approx(1.1)
    assert metrics["correction/masked_frac"] == 0.0 and metrics["mismatch/logp_abs_mean"] == pytest.approx(0.5,
                                                                                                            abs=1e-3)
