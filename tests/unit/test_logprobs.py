"""TokenLogprobs against an independent computation (the model's own logits), and the shared-prompt pass against
the full pass: same log-probs and same gradients, with gradient checkpointing and with LoRA."""

from __future__ import annotations

import pytest
import torch

from gpo.logprobs import TokenLogprobs, distinct_prompts, supports_prompt_sharing

SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0)


def tiny(kind: str, checkpointing: bool = False, lora: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**SIZES))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                                                 init_lora_weights=False))  # B != 0: A gets gradients too
    return model.train()


def batch() -> tuple[torch.Tensor, ...]:
    """6 rows of 2 prompts (left-padded, different lengths, rows interleaved); completions right-padded after EOS."""
    prompts = torch.tensor([[0, 0, 5, 6, 7], [0, 8, 9, 10, 11]])  # 0 = pad
    owner = torch.tensor([0, 0, 1, 0, 1, 1])
    prompt_ids, prompt_mask = prompts[owner], (prompts[owner] != 0).long()  # [6, 5]
    torch.manual_seed(1)
    completion_ids = torch.randint(1, 97, (6, 4))  # [6, 4]
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 2:] = 0
    completion_mask[4, 3:] = 0
    return prompt_ids, prompt_mask, completion_ids * completion_mask, completion_mask


def logprobs_and_grads(model, share: bool, temperature: float = 0.7):
    module = TokenLogprobs(model, chunk_size=7, share_prompt=share)  # chunk 7: chunks cross row boundaries
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch()
    model.zero_grad()
    logp = module(prompt_ids, prompt_mask, completion_ids, completion_mask, temperature)
    (logp * completion_mask * torch.linspace(0.5, 1.5, logp.numel()).view(logp.shape)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logp.detach() * completion_mask, grads


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("share", [False, True])
def test_token_logprobs_equal_the_models_own_logits(kind, share):
    model = tiny(kind)
    logp, _ = logprobs_and_grads(model, share)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch()
    with torch.no_grad():
        mask = torch.cat([prompt_mask, completion_mask], 1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                       position_ids=positions).logits[:, prompt_ids.shape[1] - 1 : -1] / 0.7  # [6, 4, V]
        expected = logits.log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) * completion_mask
    torch.testing.assert_close(logp, expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("kind,checkpointing,lora", [
    ("llama", False, False), ("qwen2", False, False), ("llama", True, False), ("qwen2", True, False),
    ("llama", False, True), ("llama", True, True),
])
def test_shared_prompt_pass_gives_the_full_pass_values_and_gradients(kind, checkpointing, lora):
    model = tiny(kind, checkpointing, lora)
    assert supports_prompt_sharing(model)
    full, full_grads = logprobs_and_grads(model, share=False)
    shared, shared_grads = logprobs_and_grads(model, share=True)
    torch.testing.assert_close(shared, full, atol=2e-6, rtol=0)
    assert full_grads.keys() == shared_grads.keys() and full_grads
    for name, grad in full_grads.items():
        assert grad.abs().max() > 0, name  # every trained tensor gets a gradient (the prompt's too)
        torch.testing.assert_close(shared_grads[name], grad, atol=5e-6, rtol=1e-4, msg=name)


def test_the_decoder_runs_once_per_distinct_prompt_then_once_over_the_completions():
    model = tiny("llama")
    rows: list[tuple[int, int]] = []
    model.get_decoder().register_forward_hook(
        lambda module, args, kwargs, out: rows.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch()
    TokenLogprobs(model, share_prompt=True)(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert rows == [(2, 5), (6, 4)]  # 2 distinct prompts of width 5, then 6 completions of width 4
    rows.clear()  # all prompts distinct: nothing to share, one ordinary pass
    TokenLogprobs(model, share_prompt=True)(prompt_ids[[0, 2]], prompt_mask[[0, 2]], completion_ids[[0, 2]],
                                            completion_mask[[0, 2]])
    assert rows == [(2, 9)]
    rows.clear()
    TokenLogprobs(model, share_prompt=False)(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert rows == [(6, 9)]


def test_distinct_prompts_by_hand():
    ids = torch.tensor([[1, 2], [3, 4], [1, 2], [1, 2], [3, 4]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [0, 1], [1, 1]])  # row 3: same ids, different mask: its own prompt
    first, owner = distinct_prompts(ids, mask)
    assert len(first) == 3
    torch.testing.assert_close(ids[first][owner], ids)
    torch.testing.assert_close(mask[first][owner], mask)
    assert owner[0] == owner[2] and owner[1] == owner[4] and len({int(owner[0]), int(owner[1]), int(owner[3])}) == 3


def test_sliding_window_models_do_not_share_prompts():
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    assert not supports_prompt_sharing(MistralForCausalLM(MistralConfig(**SIZES, sliding_window=4)))
    assert supports_prompt_sharing(MistralForCausalLM(MistralConfig(**SIZES, sliding_window=None)))
    assert not supports_prompt_sharing(Qwen2ForCausalLM(Qwen2Config(**SIZES, use_sliding_window=True,
                                                                     sliding_window=4, max_window_layers=0)))
    sliding = MistralForCausalLM(MistralConfig(**SIZES, sliding_window=4))
    assert not TokenLogprobs(sliding, share_prompt=True).share_prompt


@pytest.mark.parametrize("share", [False, True])
def test_entropy_comes_from_the_same_pass_detached_and_leaves_log_probs_and_gradients_unchanged(share):
    model = tiny("llama", checkpointing=True)
    plain_logp, plain_grads = logprobs_and_grads(model, share)
    module = TokenLogprobs(model, chunk_size=7, share_prompt=share)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch()
    model.zero_grad()
    logp, entropy = module(prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7, with_entropy=True)
    assert not entropy.requires_grad and entropy.numel() == logp.numel()
    (logp * completion_mask * torch.linspace(0.5, 1.5, logp.numel()).view(logp.shape)).sum().backward()
    torch.testing.assert_close(logp.detach() * completion_mask, plain_logp, atol=0, rtol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # by hand: -sum p log p of the model's own logits at temperature 0.7
        mask = torch.cat([prompt_mask, completion_mask], 1)
        logits = model(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, prompt_ids.shape[1] - 1 : -1] / 0.7
        p = logits.softmax(-1)
        expected = -(p * p.log()).sum(-1) * completion_mask  # [6, 4]
    torch.testing.assert_close(entropy.view(logp.shape) * completion_mask, expected, atol=2e-5, rtol=0)
