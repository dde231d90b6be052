"""`backend.precision`: the hf backend's bf16 / int8 generator copy, its refresh after an optimizer step, the
log-probs every precision reports, the float32 path unchanged, the vLLM mapping and the machine refusals."""

from __future__ import annotations

import math

import pytest
import torch

from gpo.backends.hf import HFBackend, HFConfig
from gpo.backends.precision import GeneratorCopy, emulated_bf16, quantize_weight, refusal, runnable, vllm_settings
from gpo.decoding import sampled_logprob
from gpo.hardware import Machine
from gpo.models import plain_weights
from gpo.types import Sampling


class Tok:
    eos_token_id, pad_token_id = 2, 0


def tiny_llama(vocab: int = 3000, tied: bool = True, init: float = 0.3) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, initializer_range=init)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def optimizer_step(model: torch.nn.Module) -> None:
    """One AdamW step on a next-token loss, so every weight moves (by about lr)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 44, 55]]


def test_float32_samples_with_the_policy_and_its_completions_are_unchanged():
    """Tokens recorded from the decoder before it reported log-probs or had a precision (same model, seed and
    sampling): computing the log-probs draws no random number and leaves the draw's weights as they were."""
    model = tiny_llama()
    backend = HFBackend(HFConfig(), model, Tok())
    assert backend.generates_with_policy and backend.generator() is model
    out = backend.generate(PROMPTS, [3, 2, 4], Sampling(max_new_tokens=20, temperature=0.7, top_p=0.9), seed=11)
    assert out[:2] == [
        [1435, 1347, 2823, 2588, 2033, 1151, 2621, 211, 898, 2330, 288, 2270, 2624, 2723, 71, 898, 309, 2799, 1902,
         2781],
        [2335, 2712, 1681, 44, 1099, 323, 2899, 2360, 2379, 1529, 1007, 2036, 1994, 2800, 979, 781, 1404, 1404, 1409,
         1115],
    ]
    assert [len(r) for r in backend.generator_logprobs()] == [len(r) for r in out]


def test_sampled_logprob_hand_values():
    # Row 0: weights (1, e^-1, e^-2), sum s = 1 + e^-1 + e^-2; token 1: log e^-1 - log s = -1 - log s.
    # Row 1: top-p left only token 0 (weights 1, 0, 0) but the sum before truncation was 1 + 0.5 + 0.25 = 1.75,
    # so token 0 keeps log(1 / 1.75), the untruncated distribution's value.
    weights = torch.tensor([[1.0, math.exp(-1), math.exp(-2)], [1.0, 0.0, 0.0]])
    totals = torch.tensor([1 + math.exp(-1) + math.exp(-2), 1.75])
    got = sampled_logprob(weights, totals, torch.tensor([1, 0]))
    s = 1 + math.exp(-1) + math.exp(-2)
    assert torch.allclose(got, torch.tensor([-1 - math.log(s), -math.log(1.75)]), atol=1e-6)


def test_bf16_copy_equals_the_policy_cast_and_follows_an_optimizer_step():
    model = tiny_llama(tied=False)
    backend = HFBackend(HFConfig(precision="bf16"), model, Tok())
    assert not backend.generates_with_policy
    copy = backend.generator()
    assert copy is not model and all(p.dtype == torch.bfloat16 for p in copy.parameters())

    def equal_after_cast() -> bool:
        mine = dict(copy.named_parameters())
        return all(torch.equal(mine[n], t.to(torch.bfloat16)) for n, t in plain_weights(model))

    assert equal_after_cast()
    before = copy.model.layers[0].mlp.up_proj.weight.clone()
    optimizer_step(model)
    assert not equal_after_cast()  # stale until synced
    backend.sync_weights(model)
    assert equal_after_cast() and not torch.equal(before, copy.model.layers[0].mlp.up_proj.weight)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.ao, the reference quantisation here
@pytest.mark.parametrize("tied", [True, False])
def test_int8_copy_is_torchs_dynamic_quantisation_and_follows_an_optimizer_step(tied):
    import copy as copying

    model = tiny_llama(tied=tied)
    backend = HFBackend(HFConfig(precision="int8"), model, Tok())
    generator = backend.generator()

    def check() -> None:
        weights = dict(plain_weights(model))
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        fresh = torch.ao.quantization.quantize_dynamic(copying.deepcopy(model), {torch.nn.Linear},
                                                       dtype=torch.qint8)
        for name, source in [("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.q_proj.weight"),
                             ("lm_head", head)]:
            q = generator.get_submodule(name).weight()
            # equal to a fresh quantize_dynamic of the policy, and within half a step of the float weights
            assert torch.equal(q.int_repr(), fresh.get_submodule(name).weight().int_repr())
            assert q.q_scale() == fresh.get_submodule(name).weight().q_scale()
            assert (q.dequantize() - weights[source]).abs().max() <= q.q_scale() / 2 + 1e-7
        assert torch.equal(generator.model.norm.weight, weights["model.norm.weight"])  # float32, copied as is

    check()
    before = generator.lm_head.weight().int_repr().clone()
    optimizer_step(model)
    backend.sync_weights(model)
    check()
    assert not torch.equal(before, generator.lm_head.weight().int_repr())


def test_int8_weight_quantisation_hand_values():
    # max |w| = 1.275, scale = 1.275 / 127.5 = 0.01; 0.5 -> 50, -1.275 -> -127.5 -> -128 (round half to even)
    q = quantize_weight(torch.tensor([[0.5, -1.275], [0.0, 0.004]]))
    assert math.isclose(q.q_scale(), 0.01, rel_tol=1e-6) and q.q_zero_point() == 0
    assert q.int_repr().tolist() == [[50, -128], [0, 0]]


def test_a_lora_policy_is_copied_with_its_adapter_merged():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(tied=True), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                             init_lora_weights=False))
    copy = GeneratorCopy(model, "bf16").model
    merged = dict(plain_weights(model))
    q = "model.layers.0.self_attn.q_proj.weight"
    base = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(merged[q], base)  # the adapter changes q_proj
    assert torch.equal(dict(copy.named_parameters())[q], merged[q].to(torch.bfloat16))


def full_forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at each completion token, from one forward over prompt + completion."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


# Largest gap measured between the decoder's log-probs and a full forward of the same generator (this test):
# float32 9.5e-7 (cached keys/values vs one pass); bf16 7.4e-3 (bfloat16 rounding along two computation orders);
# int8 9.6e-2 (each call quantises its activations with its own input's range, which differs between one decode
# step and a full pass). The tolerances leave room of about 2.5 to 10 times.
TOLERANCE = {"float32": 1e-5, "bf16": 0.03, "int8": 0.25}


@pytest.mark.parametrize("precision", ["float32", "bf16", "int8"])
def test_reported_logprobs_match_a_full_forward_of_the_generator(precision):
    model = tiny_llama(vocab=300, init=0.1)
    backend = HFBackend(HFConfig(precision=precision), model, Tok())
    sampling = Sampling(max_new_tokens=10, temperature=0.8, top_p=0.9)
    out = backend.generate([PROMPTS[0]], 3, sampling, seed=5)
    reported = backend.generator_logprobs()
    gaps = [(full_forward_logprobs(backend.generator(), PROMPTS[0], row, 0.8) - torch.tensor(lp)).abs().max()
            for row, lp in zip(out, reported, strict=True)]
    assert all(len(lp) == len(row) for row, lp in zip(out, reported, strict=True))
    assert max(gaps) < TOLERANCE[precision], gaps
    greedy = backend.generate([PROMPTS[0]], 1, Sampling(max_new_tokens=4, greedy=True), seed=0)
    assert len(greedy[0]) == 4 and backend.generator_logprobs() is None  # greedy: nothing sampled, nothing reported


# --- what each backend runs where -----------------------------------------------------------------------------


CPU_AVX512 = Machine(cuda=False, bf16=True, dynamic_int8=True)
CPU_AVX2 = Machine(cuda=False, bf16=False, dynamic_int8=True)
CPU_NO_QUANT = Machine(cuda=False, bf16=True, dynamic_int8=False)
H100 = Machine(cuda=True, bf16=True, dynamic_int8=False)
V100 = Machine(cuda=True, bf16=False, dynamic_int8=False)  # torch emulates bfloat16 there; vLLM refuses it
NO_BF16_GPU = Machine(cuda=True, bf16=False, dynamic_int8=False, bf16_emulation=False)


@pytest.mark.parametrize("backend, machine, runs", [
    ("hf", CPU_AVX512, ("float32", "bf16", "int8")),
    ("hf", CPU_AVX2, ("float32", "int8")),
    ("hf", H100, ("float32", "bf16")),
    ("vllm", CPU_AVX512, ("float32", "bf16")),
    ("vllm", H100, ("float32", "bf16", "fp16", "fp8")),
])
def test_runnable_precisions(backend, machine, runs):
    assert runnable(backend, machine) == runs
    assert refusal(backend, "auto", machine) is None and refusal(backend, "float32", machine) is None


@pytest.mark.parametrize("backend, machine", [("hf", CPU_AVX2), ("vllm", CPU_AVX2), ("hf", V100)])
def test_bf16_runs_emulated_where_the_machine_lacks_it(backend, machine):
    assert "bf16" not in runnable(backend, machine)  # not at full speed: the benchmarks leave it out
    assert emulated_bf16(backend, machine) and refusal(backend, "bf16", machine) is None


@pytest.mark.parametrize("backend, machine", [("hf", CPU_AVX512), ("hf", H100), ("vllm", H100)])
def test_native_bf16_is_not_emulated(backend, machine):
    assert not emulated_bf16(backend, machine) and refusal(backend, "bf16", machine) is None


@pytest.mark.parametrize("backend, precision, machine, says", [
    ("vllm", "bf16", V100, "backend.precision=bf16: vLLM runs bf16 only on GPUs with native bfloat16 support"),
    ("hf", "bf16", NO_BF16_GPU, "backend.precision=bf16: this CUDA GPU cannot compute in bfloat16"),
    ("hf", "int8", CPU_NO_QUANT, "install a standard torch build"),
    ("hf", "int8", V100, "backend=hf runs float32, bf16 (emulated, slower) on this machine"),
    ("hf", "int8", H100, "runs on CPU only; backend=hf runs float32, bf16 on this machine"),
    ("vllm", "fp8", CPU_AVX512, "vLLM runs fp8 on CUDA GPUs only; backend=vllm runs float32, bf16"),
])
def test_refusals_name_the_key_and_what_runs(backend, precision, machine, says):
    assert says in refusal(backend, precision, machine)


@pytest.mark.parametrize("precision, on_gpu, expected", [
    ("auto", False, {"dtype": "float32", "quantization": None}),
    ("auto", True, {"dtype": "bfloat16", "quantization": None}),  # the policy's dtype on GPU
    ("float32", True, {"dtype": "float32", "quantization": None}),
    ("bf16", False, {"dtype": "bfloat16", "quantization": None}),
    ("fp16", True, {"dtype": "float16", "quantization": None}),
    ("fp8", True, {"dtype": "bfloat16", "quantization": "fp8"}),
])
def test_vllm_settings_per_precision(precision, on_gpu, expected):
    assert vllm_settings(precision, on_gpu, torch.bfloat16) == expected
