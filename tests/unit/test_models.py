"""Loading models and tokenizers: every failure caused by what the user pointed at is a UserError naming the path
and the fix (CLI exit 2, one line, no traceback), and prompts reach models whose chat template has no system role.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import model_zoo
from gpo.config import ModelConfig
from gpo.errors import UserError
from gpo.generation import encode_prompts, fold_system_message
from gpo.models import load_policy, load_tokenizer, resolve_path
from kit import run_gpo_all

NOT_CACHED = "gpo-tests/no-such-model-in-any-cache"


# --- the broken inputs, built once --------------------------------------------------------------------------------


def tokenizer_without_template(directory: Path) -> Path:
    """A three-word tokenizer with no chat template (as base models ship), saved as a tokenizer-only directory."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({"<unk>": 0, "hello": 1, "</s>": 2}, unk_token="<unk>"))
    words.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>").save_pretrained(directory)
    return directory


def broken_inputs(root: Path) -> dict[str, Path]:
    from transformers import LlamaConfig

    empty = root / "empty"
    empty.mkdir()
    unknown = root / "unknown-arch"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "gpo_no_such_arch", "hidden_size": 8}))
    garbled = root / "garbled"
    garbled.mkdir()
    (garbled / "config.json").write_text('{"model_type": "llama", ')
    no_weights = root / "no-weights"
    LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1).save_pretrained(
        no_weights)
    no_template = tokenizer_without_template(root / "no-template")
    LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1).save_pretrained(
        no_template)  # a model directory whose tokenizer has no template: the tokenizer check comes first
    return {"empty": empty, "unknown": unknown, "garbled": garbled, "no_weights": no_weights,
            "no_template": no_template}


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, Path]:
    return broken_inputs(tmp_path_factory.mktemp("broken"))


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network and an empty Hub cache, as on a machine that never downloaded the model."""
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # read once at import: set the constant too
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))


# --- function level -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/no/such/dir", "./no-such-dir", "runs/no-such-run/final", "~/no-such-gpo-dir"])
def test_a_missing_local_path_names_the_path(path):
    with pytest.raises(UserError) as error:
        resolve_path(path)
    assert str(error.value).startswith(f"model path `{Path(path).expanduser()}` does not exist. Check the path")


def test_a_file_is_not_a_model_directory(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(UserError, match=f"model path `{weights}` is a file, not a model directory"):
        load_policy(ModelConfig(path=str(weights)))


def test_a_directory_without_config_json_says_what_to_point_at(broken):
    for load in (load_policy, load_tokenizer):
        with pytest.raises(UserError, match=f"`{broken['empty']}` has no config.json.*save_pretrained"):
            load(ModelConfig(path=str(broken["empty"])))


def test_an_unknown_architecture_names_the_model_type_and_the_fix(broken):
    for load in (load_policy, load_tokenizer):
        with pytest.raises(UserError, match=r"model_type `gpo_no_such_arch`, an architecture transformers \S+ does "
                                            r"not know\. Upgrade transformers"):
            load(ModelConfig(path=str(broken["unknown"])))


def test_an_unreadable_config_json_is_a_user_error(broken):
    with pytest.raises(UserError, match=f"cannot read `{broken['garbled'] / 'config.json'}`"):
        load_policy(ModelConfig(path=str(broken["garbled"])))


def test_a_model_directory_without_weights_is_a_user_error(broken):
    with pytest.raises(UserError, match=f"cannot load model `{broken['no_weights']}`: .*complete model"):
        load_policy(ModelConfig(path=str(broken["no_weights"])))


def test_a_hub_name_that_is_not_cached_while_offline(offline):
    for load, what in ((load_tokenizer, "tokenizer"), (load_policy, "model")):
        with pytest.raises(UserError) as error:
            load(ModelConfig(path=NOT_CACHED))
        message = str(error.value)
        assert message.startswith(f"cannot load {what} `{NOT_CACHED}`:")
        assert "not in the Hugging Face cache" in message and "HF_HUB_OFFLINE=1" in message
        assert f"hf download {NOT_CACHED}" in message  # the fix


def test_a_tokenizer_without_a_chat_template(broken):
    with pytest.raises(UserError, match=f"the tokenizer of `{broken['no_template']}` has no chat template.*"
                                        "model.tokenizer="):
        load_tokenizer(ModelConfig(path=str(broken["no_template"])))


def test_a_tokenizer_only_directory_is_accepted_as_model_tokenizer(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path)  # no config.json beside it
    tokenizer = load_tokenizer(ModelConfig(path="unused", tokenizer=str(tmp_path)))
    assert tokenizer.chat_template and tokenizer.padding_side == "left"


# --- the CLI: exit 2, one line naming the path, no traceback -----------------------------------------------------


def one_line_error(stderr: str) -> str:
    """The error contract: no traceback, and the last line of stderr is the one `gpo: error:` line (notes such as
    `backend=auto picked ...` may come before it)."""
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("gpo: error: ")]
    assert "Traceback" not in stderr and errors == lines[-1:], stderr
    return lines[-1]


def test_gpo_run_on_a_missing_path_exits_2_naming_it(tmp_path):
    """The issue's report, in a real process: `gpo run model.path=/no/such/dir` ended in a traceback (exit 1)."""
    (proc,) = run_gpo_all({"run": (["run", "model.path=/no/such/dir", "tracker=none", f"output_dir={tmp_path}"],
                                   [])}).values()
    assert proc.returncode == 2
    assert "model path `/no/such/dir` does not exist" in one_line_error(proc.stderr)


@pytest.mark.parametrize("command, key, expected", [
    ("eval", None, "model path `/no/such/dir` does not exist"),  # `model=PATH` as well as `model.path=PATH`
    ("run", "empty", "has no config.json: not a transformers model directory"),
    ("eval", "unknown", "model_type `gpo_no_such_arch`"),
    ("run", "no_template", "has no chat template"),
    ("run", "no_weights", "cannot load tokenizer"),  # neither tokenizer files nor weights: the tokenizer loads first
])
def test_loading_failures_exit_2_with_one_line_naming_the_path(broken, command, key, expected, tmp_path, capsys):
    from gpo import cli

    path = str(broken[key]) if key else "/no/such/dir"
    extra = ["task=arith", "limit=1"] if command == "eval" else ["train.steps=1"]
    assert cli.main([command, f"model={path}", *extra, "tracker=none", f"output_dir={tmp_path}"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert expected in line and path in line


def test_an_offline_hub_name_exits_2_with_the_fix(offline, tmp_path, capsys):
    from gpo import cli

    assert cli.main(["run", f"model={NOT_CACHED}", "tracker=none", f"output_dir={tmp_path}"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert f"cannot load tokenizer `{NOT_CACHED}`" in line and f"hf download {NOT_CACHED}" in line


# --- chat templates without a system role ------------------------------------------------------------------------


def test_fold_system_message_prepends_it_to_the_first_user_turn():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]
    assert fold_system_message(messages) == [{"role": "user", "content": "Be brief.\n\n2+2?"},
                                             {"role": "assistant", "content": "4"},
                                             {"role": "user", "content": "3+3?"}]
    assert fold_system_message(messages[1:]) == messages[1:]  # nothing to fold
    assert fold_system_message(messages[:1]) == [{"role": "user", "content": "Be brief."}]


@pytest.fixture(scope="module")
def gemma_style():
    reason = model_zoo.missing()
    if reason:
        pytest.skip(reason)
    return model_zoo.gemma_style_tokenizer()


def test_the_system_text_reaches_a_template_without_system_role(gemma_style):
    from jinja2 import TemplateError

    messages = [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "What is 2+3?"}]
    with pytest.raises(TemplateError, match="System role not supported"):
        gemma_style.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    (ids,) = encode_prompts(gemma_style, [messages], 256)
    text = gemma_style.decode(ids)
    assert text.endswith("<start_of_turn>user\nThink step by step.\n\nWhat is 2+3?<end_of_turn>\n"
                         "<start_of_turn>model\n")
    # Conversations without a system message are encoded exactly as the template renders them.
    plain = messages[1:]
    assert encode_prompts(gemma_style, [plain], 256)[0] == gemma_style.apply_chat_template(
        plain, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_a_template_that_rejects_the_prompt_for_another_reason_is_a_user_error(gemma_style):
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    strict = gemma_style.chat_template.replace(
        "{% for m in messages %}",
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}", 1)
    try:
        gemma_style.chat_template = strict
        with pytest.raises(UserError, match="chat template rejects the task's prompt: roles must alternate"):
            encode_prompts(gemma_style, [two_users], 256)
    finally:
        gemma_style.chat_template = model_zoo.NO_SYSTEM_TEMPLATE

