"""Precisions as users type them and as the machine runs them: torch's names (bfloat16, float16, half, fp32) are other
names of gpo's values, replaced by them when the config is validated; a bf16 asked for explicitly runs where
bfloat16 is only emulated, and the run says once that it is slower there. The `auto` precisions still resolve to
what is fast (tests/unit/test_auto_precision.py)."""

from __future__ import annotations

import pytest
import torch

from gpo import cli, config, hardware, preflight
from gpo.config import as_layer, compose, layer_yaml
from gpo.errors import UserError

BASE = ["tracker=none", "backend=hf"]
AVX2 = hardware.Machine(cuda=False, bf16=False, dynamic_int8=True)  # bfloat16 emulated, several times slower
AVX512 = hardware.Machine(cuda=False, bf16=True, dynamic_int8=True)
EMULATED = "this CPU has no native bfloat16 support, so bf16 is emulated here and runs slower than float32"


@pytest.fixture
def on(monkeypatch):
    """Run the machine checks as on `machine`, with the once-per-process notes forgotten."""
    monkeypatch.setattr(config, "_said", set())
    monkeypatch.setattr(preflight, "BACKEND_PACKAGES", {})  # backend=vllm's package is not what these are about

    def machine(m: hardware.Machine) -> None:
        monkeypatch.setattr(hardware, "this_machine", lambda: m)
    return machine


def value(cfg, key: str):
    section, field = key.split(".")
    return getattr(getattr(cfg, section), field)


@pytest.mark.parametrize("pick, key, typed, canonical", [
    ("backend=hf", "backend.precision", "bfloat16", "bf16"),
    ("backend=hf", "backend.precision", "fp32", "float32"),
    ("backend=vllm", "backend.precision", "bfloat16", "bf16"),
    ("backend=vllm", "backend.precision", "float16", "fp16"),
    ("backend=vllm", "backend.precision", "half", "fp16"),
    ("backend=hf", "model.dtype", "bf16", "bfloat16"),
    ("backend=hf", "model.dtype", "fp16", "float16"),
    ("backend=hf", "model.dtype", "half", "float16"),
    ("backend=hf", "model.dtype", "fp32", "float32"),
    ("backend=hf", "engine.mixed_precision", "bfloat16", "bf16"),
    ("backend=hf", "engine.mixed_precision", "float16", "fp16"),
    ("backend=hf", "engine.mixed_precision", "float32", "no"),  # no mixed precision: float32 throughout
    ("backend=hf", "engine.logprob_precision", "bfloat16", "bf16"),
    ("backend=hf", "engine.logprob_precision", "fp32", "no"),
])
def test_each_other_name_composes_to_the_canonical_value(pick, key, typed, canonical):
    cfg = compose(["tracker=none", pick, f"{key}={typed}"])
    assert value(cfg, key) == canonical
    assert f"{key.split('.')[1]}: {typed}" not in layer_yaml(cfg)  # the saved config holds the canonical value
    assert compose(layers=[as_layer(cfg)]) == cfg


def test_a_config_file_and_a_layer_are_normalised_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("backend: {precision: bfloat16}\nengine: {mixed_precision: float32}\n")
    cfg = compose(BASE, config_files=[path])
    assert (cfg.backend.precision, cfg.engine.mixed_precision) == ("bf16", "no")
    assert compose(BASE, layers=[{"model": {"dtype": "bf16"}}]).model.dtype == "bfloat16"


def test_a_name_of_a_precision_the_backend_lacks_is_refused_with_its_choices():
    with pytest.raises(UserError, match=r"`backend.precision` must be one of auto, float32, bf16, int8; got `half`"):
        compose([*BASE, "backend.precision=half"])  # fp16 is vLLM's, not gpo's decoder's
    with pytest.raises(UserError, match=r"`model.dtype` must be one of float32, bfloat16, float16; got `int8`"):
        compose([*BASE, "model.dtype=int8"])


def test_backend_auto_weighs_the_precision_by_its_canonical_name(monkeypatch):
    import gpo.backends

    weighed = []

    def pick_auto(max_new_tokens: int, precision: str = "float32") -> tuple[str, str]:
        weighed.append(precision)
        return "hf", "picked for the test"
    monkeypatch.setattr(gpo.backends, "pick_auto", pick_auto)
    assert compose(["tracker=none", "backend=auto", "backend.precision=bfloat16"]).backend.precision == "bf16"
    assert weighed == ["bf16"]


# --- bf16 where the machine has no native bfloat16 --------------------------------------------------------------


def dry_run(*args: str) -> int:
    return cli.main(["run", "--dry-run", *BASE, *args])


def test_bf16_rollouts_compose_and_run_on_a_cpu_without_bf16_saying_so_once(on, capsys, tmp_path):
    on(AVX2)
    assert compose([*BASE, "backend.precision=bf16"]).backend.precision == "bf16"
    assert dry_run(f"output_dir={tmp_path}", "backend.precision=bf16") == 0
    assert dry_run(f"output_dir={tmp_path}", "backend.precision=bf16") == 0
    out, err = capsys.readouterr()
    assert "precision: bf16" in out.split("backend:")[1]
    assert err == f"gpo: backend.precision=bf16: {EMULATED} (float32: backend.precision=float32).\n"


@pytest.mark.parametrize("args, says", [
    (["engine.mixed_precision=bf16"], "engine.mixed_precision=bf16: "),
    (["engine.mixed_precision=no", "engine.logprob_precision=bf16"], "engine.logprob_precision=bf16: "),
    (["model.dtype=bf16", "engine.mixed_precision=no"], "model.dtype=bfloat16: "),
    (["backend=vllm", "backend.precision=bfloat16", "engine.mixed_precision=bf16"],
     f"engine.mixed_precision=bf16 backend.precision=bf16: {EMULATED} (float32: engine.mixed_precision=no "
     f"backend.precision=float32)."),
])
def test_every_explicit_bf16_runs_where_it_is_emulated_and_is_named_in_the_one_line(on, capsys, tmp_path, args,
                                                                                     says):
    on(AVX2)
    assert dry_run(f"output_dir={tmp_path}", *args) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if EMULATED in line]
    assert len(said) == 1 and said[0].startswith(f"gpo: {says}"), said


def test_native_bf16_and_float32_say_nothing(on, capsys, tmp_path):
    on(AVX512)
    assert dry_run(f"output_dir={tmp_path}", "backend.precision=bf16", "engine.mixed_precision=bf16") == 0
    on(AVX2)
    assert dry_run(f"output_dir={tmp_path}", "backend.precision=float32", "engine.mixed_precision=no") == 0
    assert capsys.readouterr().err == ""


def a_gpu_emulating_bf16(monkeypatch) -> None:
    """A GPU before compute capability 8.0: torch emulates bfloat16 there (is_bf16_supported counts emulation)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")


def test_a_gpu_that_emulates_bf16_runs_it_and_auto_stays_float32_there(monkeypatch, capsys, tmp_path):
    a_gpu_emulating_bf16(monkeypatch)
    monkeypatch.setattr(config, "_said", set())
    machine = hardware.this_machine()
    assert machine.cuda and not machine.bf16 and not machine.bf16_instructions and machine.bf16_emulation
    monkeypatch.delenv(hardware.AUTO_PRECISION_ENV, raising=False)
    assert hardware.auto_precision()[0] == "float32"  # auto picks what is fast: not an emulated bf16
    assert dry_run(f"output_dir={tmp_path}", "engine.mixed_precision=bf16", "backend.precision=bf16") == 0
    err = capsys.readouterr().err
    assert "engine.mixed_precision=bf16 backend.precision=bf16: this CUDA GPU has no native bfloat16 support" in err
