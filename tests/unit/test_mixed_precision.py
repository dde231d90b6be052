"""Mixed-precision updates at module level (docs/precision.md): TokenLogprobs under `precision=bf16` runs the
decoder's matrix products in bf16 and its LM head and log-softmax in float32, and one micro-batch's loss and
gradients agree with float32 within bf16's accuracy; parameters, gradients and AdamW state stay float32.

Tolerances: bf16 keeps 8 significant bits, so each rounded operand carries a relative error up to 2^-9 ~ 2e-3,
and through a 2-layer decoder the log-probs move by ~1e-2 nats. A loss is a mean of such terms times advantages
of order 1: relative 2e-2 on the loss. The gradient's direction, not each entry (entries near 0 have large
relative errors), is what an update follows: cosine similarity > 0.99 on the flattened gradient, and its norm
within 5%."""

from __future__ import annotations

import pytest
import torch

from gpo.logprobs import TokenLogprobs, computing_in
from gpo.types import StepTotals
from kit import build_objective, micro_batch

SIZES = dict(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0)


def tiny() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SIZES)).train()


def rows() -> tuple[torch.Tensor, ...]:
    """6 rows of 2 left-padded prompts, completions of 8 tokens right-padded after their end."""
    prompts = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])  # 0 = pad
    owner = torch.tensor([0, 0, 0, 1, 1, 1])
    prompt_ids, prompt_mask = prompts[owner], (prompts[owner] != 0).long()  # [6, 6]
    completion_ids = (torch.arange(48).view(6, 8) * 37 % 210 + 1)  # [6, 8], fixed tokens in 1..210
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 5:] = 0
    completion_mask[4, 2:] = 0
    return prompt_ids, prompt_mask, completion_ids * completion_mask, completion_mask


def loss_and_grad(model, objective, precision: str, old: torch.Tensor, ref: torch.Tensor):
    """One micro-batch's loss and flattened gradient, with the log-probs under `precision`."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = rows()
    model.zero_grad()
    logp = TokenLogprobs(model, chunk_size=16, precision=precision)(prompt_ids, prompt_mask, completion_ids,
                                                                     completion_mask)
    advantages = torch.tensor([1.0, -0.5, 0.8, -0.2, 0.3, 0.4])  # [6], mean 0.3: no loss that cancels to ~0
    mb = micro_batch(advantages, completion_mask, old_logprobs=old, ref_logprobs=ref, dtype=torch.float32)
    totals = StepTotals(sequences=6, tokens=int(completion_mask.sum()))
    loss, _ = objective.loss(logp, mb, totals)
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert grad.dtype == torch.float32  # autocast's casts send float32 gradients back to the float32 weights
    return loss.detach(), grad, logp.detach() * completion_mask


@pytest.mark.parametrize("name, cfg", [
    ("grpo", {"beta": 0.04}),  # token-level clipped ratio, with the KL term on the reference log-probs
    # GSPO's own surrogate (one ratio per sequence); its paper clip of 3e-4 is below bf16's log-prob noise, so the
    # range is widened to keep every ratio of this batch inside it at both precisions (compared: the maths, not
    # which rows bf16 noise pushes over a 3e-4 edge).
    ("gspo", {"epsilon_low": 0.2, "epsilon_high": 0.2}),
])
def test_bf16_loss_and_gradient_agree_with_float32(name, cfg):
    model, objective = tiny(), build_objective(name, **cfg)
    with torch.no_grad():
        fp32_logp = TokenLogprobs(model)(*rows()) * rows()[3]
    # Old and reference log-probs 0.05 nats off the float32 ones, alternating in sign: ratios exp(+-0.05), well
    # inside the 0.2 clip range at both precisions, so the surrogate's gradient is live on every token.
    offset = 0.05 * (torch.arange(fp32_logp.numel()).view(fp32_logp.shape) % 2 * 2 - 1)
    old, ref = fp32_logp + offset, fp32_logp - offset
    loss32, grad32, logp32 = loss_and_grad(model, objective, "no", old, ref)
    loss16, grad16, logp16 = loss_and_grad(model, objective, "bf16", old, ref)
    assert not torch.equal(logp16, logp32)  # bf16 did run
    assert (logp16 - logp32).abs().max() < 1e-2  # measured ~1e-3 on this model
    assert abs(float(loss16 - loss32)) <= 2e-2 * abs(float(loss32))
    assert torch.nn.functional.cosine_similarity(grad16, grad32, dim=0) > 0.99
    assert abs(float(grad16.norm() / grad32.norm()) - 1) < 5e-2


def test_bf16_decoder_matmuls_and_float32_head():
    """The decoder's projections return bf16; the log-probs equal a float32 head and log-softmax applied, outside
    any autocast, to the hidden states that bf16 decoder produced."""
    model = tiny()
    seen, hidden = {}, {}
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, out: seen.update(q=out.dtype))
    model.model.norm.register_forward_hook(lambda m, i, out: hidden.update(h=out.detach()))
    prompt_ids, prompt_mask, completion_ids, completion_mask = rows()
    module = TokenLogprobs(model, share_prompt=False, precision="bf16")
    with torch.no_grad():
        logp = module(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert seen["q"] == torch.bfloat16
    h = hidden["h"][:, prompt_ids.shape[1] - 1 : -1].float()  # [6, 8, H]: the state before each completion token
    by_hand = (h @ model.lm_head.weight.T).log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp, by_hand, atol=1e-5, rtol=0)


def test_precision_overrides_an_outer_autocast_and_computing_in_restores_it():
    """A prepared module's forward runs inside Accelerate's autocast: the module's own setting still decides."""
    model = tiny()
    module = TokenLogprobs(model, precision="bf16")
    args = rows()
    with torch.no_grad():
        fp32 = TokenLogprobs(model, precision="no")(*args)
        with torch.autocast("cpu", dtype=torch.bfloat16), computing_in(module, "no"):
            assert torch.equal(module(*args), fp32)
        assert module.precision == "bf16"
        assert not torch.equal(module(*args), fp32)


def test_parameters_gradients_and_adamw_state_stay_float32_after_a_bf16_step():
    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    prompt_ids, prompt_mask, completion_ids, completion_mask = rows()
    logp = TokenLogprobs(model, precision="bf16")(prompt_ids, prompt_mask, completion_ids, completion_mask)
    (logp * completion_mask).sum().backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    optimizer.step()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    state = [s for p in model.parameters() for s in optimizer.state[p].values() if s.dim() > 0]
    assert len(state) == 2 * len(before) and {s.dtype for s in state} == {torch.float32}  # exp_avg, exp_avg_sq
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())  # the step did move them
