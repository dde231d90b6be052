"""Every built-in task and backend implements what the engine calls on it without `getattr`: `close()` (safe
twice) and, for backends, `generates_with_policy` (whether ZeRO-3 must gather the policy around generation)."""

from __future__ import annotations

import pytest
import torch

from gpo import registry
from gpo.types import Backend, Task

BUILTIN_TASKS = ("aime24", "amc23", "arith", "gsm8k", "math")
BUILTIN_BACKENDS = ("hf", "vllm")


@pytest.fixture(scope="module", autouse=True)
def builtins() -> None:
    registry.load_builtins()


def test_the_protocols_declare_close():
    class Empty:
        pass

    # registry.missing_members reads the interface off the Protocol: a class without anything lacks all of it
    # (the methods the engine calls, listed here by hand; later additions to a Protocol only add to the set).
    assert {"`load()`", "`prompt()`", "`reward()`", "`grade()`", "`close()`"} <= set(
        registry.missing_members("task", Empty))
    assert {"`generate()`", "`generator_logprobs()`", "`sync_weights()`", "`close()`", "`generates_with_policy`",
            "`per_prompt_counts`"} <= set(registry.missing_members("backend", Empty))
    assert registry.missing_members("task", registry.get("task", "arith").cls) == []


@pytest.mark.parametrize("kind, name",
                         [("task", n) for n in BUILTIN_TASKS] + [("backend", n) for n in BUILTIN_BACKENDS])
def test_builtins_implement_every_protocol_method(kind, name):
    cls = registry.get(kind, name).cls
    protocol = Task if kind == "task" else Backend
    missing = registry.missing_members(kind, cls)
    assert not missing, f"{kind} `{name}` lacks {missing}"
    # Its own method, not the Protocol's empty body (the classes do not inherit from the Protocols).
    assert cls.close is not protocol.close


def test_backends_say_whether_they_generate_with_the_policy():
    assert registry.get("backend", "hf").cls.generates_with_policy is True  # ZeRO-3 gathers around its forwards
    assert registry.get("backend", "vllm").cls.generates_with_policy is False  # its own weights, synced
    # a bf16 / int8 copy of the policy is the hf backend's own weights, like vLLM's
    hf = registry.get("backend", "hf")
    assert hf.build({"precision": "bf16"}, model=None, tokenizer=None).generates_with_policy is False
    assert hf.build({"precision": "float32"}, model=None, tokenizer=None).generates_with_policy is True


@pytest.mark.parametrize("name", ["aime24", "amc23", "arith", "gsm8k"])
def test_closing_a_task_that_holds_nothing_twice_is_harmless_and_it_still_works(name):
    task = registry.get("task", name).build()
    task.close()
    task.close()
    example = {"gold": "7", "question": "q", "problem": "q"}
    grades = task.grade(["<think>x</think>\n<answer>\\boxed{7}</answer>"], [example])
    assert [g.correct for g in grades] == [True]


def test_closing_the_hf_backend_twice_is_harmless():
    backend = registry.get("backend", "hf").build(model=None, tokenizer=None)
    backend.close()
    backend.close()
    assert backend.model is None  # it frees nothing of the trainer's


@pytest.mark.parametrize("backend, zero_stage, gathers", [("hf", 3, True), ("vllm", 3, False), ("hf", 2, False)])
def test_zero3_gathers_the_policy_only_for_a_backend_that_generates_with_it(monkeypatch, backend, zero_stage,
                                                                          gathers):
    import contextlib
    from types import SimpleNamespace

    from gpo import parallel

    entered = []

    @contextlib.contextmanager
    def recording(model):
        entered.append(model)
        yield

    monkeypatch.setattr(parallel, "full_parameters", recording)
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage)))
    policy = torch.nn.Linear(2, 2)
    needed = registry.get("backend", backend).cls.generates_with_policy
    with parallel.gathered(accelerator, policy, needed=needed):
        pass
    assert entered == ([policy] if gathers else [])
