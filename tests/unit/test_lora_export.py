"""The policy as a plain model (gpo.models.plain_weights / export_model): a LoRA adapter folded into its base
weights, checked against peft's own merge_and_unload on a copy, with the trained model left untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from gpo.models import export_model, has_adapter, plain_weights


def tiny_llama(tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def with_lora(model: torch.nn.Module, **extra) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: B != 0, so the adapter changes the weights (a fresh adapter's B is zero).
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM",
                        init_lora_weights=False, **extra)
    return get_peft_model(model, config)


def peft_merged(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in copy.deepcopy(model).merge_and_unload().named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
def test_plain_weights_equal_peft_merge_and_leave_the_model_untouched(tied):
    model = with_lora(tiny_llama(tied))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ours = dict(plain_weights(model))
    expected = peft_merged(model)
    assert ours.keys() == expected.keys()
    assert not any("lora_" in n or "base_layer" in n for n in ours)
    for name, tensor in expected.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)
    changed = [n for n in expected if "q_proj" in n or "v_proj" in n or "down_proj" in n]
    assert changed and all(not torch.equal(ours[n], before[f"base_model.model.{n}".replace(
        ".weight", ".base_layer.weight")]) for n in changed)  # the adapter did change them
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in before)  # no merge/unmerge rounding on the model


def test_a_full_state_gives_the_same_weights_as_the_live_parameters():
    """The ZeRO-3 path: names as the model's state_dict (tied head included), the same merged tensors."""
    model = with_lora(tiny_llama(tied=True))
    live = dict(plain_weights(model))
    from_state = dict(plain_weights(model, model.state_dict()))
    assert set(live) <= set(from_state)
    assert set(from_state) - set(live) == {"lm_head.weight"}  # tied: the state names it, named_parameters once
    for name, tensor in live.items():
        torch.testing.assert_close(from_state[name], tensor, rtol=0, atol=0)


def test_scaling_and_fan_in_fan_out_follow_peft():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    # GPT-2's Conv1D stores weights transposed: peft's fan_in_fan_out; rsLoRA changes the scaling to alpha/sqrt(r).
    model = get_peft_model(gpt2, LoraConfig(r=2, lora_alpha=6, target_modules=["c_attn"], fan_in_fan_out=True,
                                            use_rslora=True, init_lora_weights=False))
    ours, expected = dict(plain_weights(model)), peft_merged(model)
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)


def test_a_plain_model_passes_through():
    model = tiny_llama(tied=False)
    assert not has_adapter(model)
    assert {n: p for n, p in plain_weights(model)}.keys() == dict(model.named_parameters()).keys()


def test_export_saves_a_plain_model_that_computes_what_the_adapted_one_does(tmp_path):
    from transformers import AutoModelForCausalLM

    model = with_lora(tiny_llama(tied=True)).eval()
    export_model(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert has_adapter(model)  # still the trained peft model
