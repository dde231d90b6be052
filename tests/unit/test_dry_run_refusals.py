"""Bad values that `gpo run --dry-run` refuses before anything loads: exit code 2, one line naming the key, no
traceback (config rules in gpo.schema and gpo.config, machine checks in gpo.preflight); and `gpo study --help`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from gpo import checkpoint, cli
from gpo.run_config import StudyConfig
from gpo.schema import valid_run_name, valid_tracking_uri

QUICK = ["tracker=none", "backend=hf"]  # the cases below set the key they are about on top of these


def refused(capsys, *args: str) -> str:
    """The one error line of `gpo run --dry-run ARGS`, after checking exit code 2 and that nothing else printed."""
    assert cli.main(["run", "--dry-run", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpo: error: "), err
    return lines[0]


def make_checkpoint(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"{checkpoint.PREFIX}{step}"
    path.mkdir(parents=True)
    (path / checkpoint.STATE_FILE).write_text(json.dumps({"step": step}))
    return path


# --- counts that must fit in the group --------------------------------------------------------------------------


@pytest.mark.parametrize("args, says", [
    (["selector=screen", "selector.n_screen=9", "train.group_size=8"], "selector.n_screen=9 is not smaller than "
                                                                       "train.group_size=8"),
    (["selector=screen", "selector.n_screen=8", "train.group_size=8"], "must be < 8"),  # screens the whole group
    (["selector=screen", "train.group_size=4"], "selector.n_screen=4"),  # the default n_screen against a small G
    (["pruner=topk", "pruner.keep=9", "train.group_size=8"], "`pruner.keep` with train.group_size=8"),
    # k = 2 - round(2 * 0.75) = 2 - round(1.5) = 0 (half rounds up): nothing would be kept
    (["pruner=topk", "pruner.rate=0.75", "train.group_size=2"], "keeps 0 of a group of 2"),
    (["pruner=threshold", "pruner.min_keep_per_group=5", "train.group_size=4"], "pruner.min_keep_per_group=5"),
])
def test_a_count_larger_than_the_group_is_refused(capsys, args, says):
    assert says in refused(capsys, *QUICK, *args)


# --- the generator/trainer correction ------------------------------------------------------------------------------


@pytest.mark.parametrize("args, says", [
    (["correction=tis", "correction.cap=0.5"], "`correction.cap` must be >= 1.0, got 0.5"),
    (["correction=tis", "correction.level=word"], "`correction.level` must be one of token, sequence"),
    (["correction=mis", "correction.lower=-0.1"], "`correction.lower` must be >= 0.0, got -0.1"),
    (["correction=mis", "correction.upper=0.5"], "`correction.upper` must be >= 1.0, got 0.5"),  # drops ratio 1
    # inverted and empty bands: the rule between the two fields
    (["correction=mis", "correction.lower=1", "correction.upper=1"], "`correction.lower`=1.0 is not below "
                                                                     "`correction.upper`=1.0"),
    (["correction=icepop", "correction.lower=1", "correction.upper=1"], "Set lower < 1 < upper"),
    (["correction=icepop", "correction.lower=nan"], "Valid: >= 0 and <= 1"),
    # the keys that moved out of the objectives name their replacements
    (["algo.is_correction=sequence"], "`algo.is_correction` is no longer a setting: the correction is a component "
                                      "of its own: `correction=tis correction.level=token`"),
    (["algo=dapo", "algo.is_cap=3"], "`algo.is_cap` is no longer a setting: the cap is `correction.cap`"),
])
def test_a_bad_correction_is_refused(capsys, args, says):
    assert says in refused(capsys, *QUICK, *args)


# --- a generator running ahead (train.max_staleness >= 1) ------------------------------------------------------


@pytest.mark.parametrize("args, says", [
    (["engine=zero2"], "not under DeepSpeed"),
    (["backend=vllm", "backend.report_logprobs=false"], "set backend.report_logprobs=true"),
    (["backend.decode=generate"], "needs the generator's log-probs of its tokens"),
    (["train.max_staleness=-1"], "`train.max_staleness` must be >= 0"),
    (["train.max_staleness=0", "train.weight_updates=inflight"], "set train.max_staleness >= 1"),
    (["train.weight_updates=always"], "`train.weight_updates`"),
    (["train.max_staleness=0", "engine.generator=ray"], "set train.max_staleness >= 1"),
])
def test_what_async_rollouts_do_not_support_is_refused(capsys, args, says):
    max_staleness = [] if any(a.startswith("train.max_staleness") for a in args) else ["train.max_staleness=1"]
    line = refused(capsys, *QUICK, *max_staleness, *args)
    assert says in line, line


def test_a_ray_generator_without_ray_installed_is_refused_saying_how_to_install_it(capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    line = refused(capsys, *QUICK, "train.max_staleness=1", "engine.generator=ray")
    assert "pip install 'gpo[ray]'" in line, line


# --- where the run is written -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../elsewhere", "a/b", "/abs", "..", ".", "a\\b"])
def test_a_run_name_that_leaves_output_dir_is_refused(capsys, tmp_path, name):
    line = refused(capsys, *QUICK, f"output_dir={tmp_path}", f"run_name={name}")
    assert "`run_name`" in line
    assert not any(tmp_path.iterdir())  # and nothing was created


def test_an_output_dir_that_is_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "taken").write_text("")
    assert "output_dir=" in refused(capsys, *QUICK, f"output_dir={tmp_path / 'taken'}")
    assert "is a file" in refused(capsys, *QUICK, f"output_dir={tmp_path / 'taken' / 'below'}")


def test_a_run_folder_that_is_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "r").write_text("")
    line = refused(capsys, *QUICK, f"output_dir={tmp_path}", "run_name=r")
    assert line.startswith("gpo: error: run_name=r:") and "is a file" in line


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write anywhere")
def test_an_output_dir_without_write_permission_is_refused(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        line = refused(capsys, *QUICK, f"output_dir={locked / 'runs'}")
    finally:
        locked.chmod(0o755)
    assert "output_dir=" in line and "no write permission" in line


# --- resume -----------------------------------------------------------------------------------------------------


def test_resume_must_name_something_that_exists(capsys, tmp_path):
    line = refused(capsys, *QUICK, f"output_dir={tmp_path}", f"resume={tmp_path / 'nope'}")
    assert f"resume={tmp_path / 'nope'}" in line and "does not exist" in line and "resume=auto" in line
    (tmp_path / "file").write_text("")
    assert "is a file" in refused(capsys, *QUICK, f"output_dir={tmp_path}", f"resume={tmp_path / 'file'}")
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    line = refused(capsys, *QUICK, f"output_dir={tmp_path}", f"resume={tmp_path / 'empty_run'}")
    assert f"no checkpoint in {tmp_path / 'empty_run' / 'checkpoints'}" in line


def test_resume_takes_auto_a_run_folder_its_checkpoints_or_one_checkpoint(capsys, tmp_path):
    step = make_checkpoint(tmp_path / "old", 3)
    for resume in ["auto", tmp_path / "old", tmp_path / "old" / "checkpoints", step]:
        assert cli.main(["run", "--dry-run", *QUICK, f"output_dir={tmp_path}", f"resume={resume}"]) == 0, resume
        assert f"resume: {resume}" in capsys.readouterr().out


# --- packages and the tracking store ----------------------------------------------------------------------------


def test_backend_vllm_without_vllm_is_refused_without_importing_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # importlib.util.find_spec then reports it missing
    line = refused(capsys, "tracker=none", "backend=vllm")
    assert "backend=vllm" in line and "pip install vllm" in line and "backend=hf" in line


@pytest.mark.parametrize("uri", ["htp:/x", "http//host", "http:/x", "http://", "https://:5000/", "sqlite:/x.db",
                                 "sqlite://", "mysql:///db", "//host/x", "file:", " "])
def test_a_malformed_tracking_uri_is_refused(capsys, uri):
    assert "`tracker.uri`" in refused(capsys, "backend=hf", "tracker=mlflow", f"tracker.uri='{uri}'")


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "https://mlflow.example.org/path", "sqlite:///runs/m.db",
                                 "sqlite:////abs/m.db", "postgresql+psycopg2://u:p@db:5432/mlflow", "databricks",
                                 "databricks://profile", "databricks-uc", "uc:http://localhost:8080",
                                 "file:///tmp/mlruns", "runs/mlruns", "/abs/mlruns"])
def test_valid_tracking_uris_pass(uri):
    assert valid_tracking_uri(uri) == uri


@pytest.mark.parametrize("name", ["cppo-arith-1", "a.b", "..x", "2026-12-05"])
def test_valid_run_names_pass(name):
    assert valid_run_name(name) == name


def test_a_directory_store_needs_mlflows_opt_in(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    line = refused(capsys, "backend=hf", "tracker=mlflow", f"output_dir={tmp_path}", f"tracker.uri={tmp_path}/ml")
    assert "MLFLOW_ALLOW_FILE_STORE=true" in line and "sqlite:///" in line
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert cli.main(["run", "--dry-run", "backend=hf", f"output_dir={tmp_path}", f"tracker.uri={tmp_path}/ml"]) == 0


# --- mixed precision ----------------------------------------------------------------------------------------------


def cpu_only(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def a_gpu_without_bf16(monkeypatch):
    """A GPU that cannot compute in bfloat16 at all, not even emulated."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla K80")


@pytest.mark.parametrize("key", ["mixed_precision", "logprob_precision"])
def test_fp16_on_cpu_is_refused_with_what_the_machine_runs(capsys, monkeypatch, key):
    cpu_only(monkeypatch)
    line = refused(capsys, *QUICK, f"engine.{key}=fp16")
    assert f"engine.{key}=fp16: fp16 needs a CUDA GPU" in line and f"runs engine.{key}=no or bf16." in line


def test_bf16_on_a_gpu_that_cannot_compute_it_is_refused_with_what_it_runs(capsys, monkeypatch):
    a_gpu_without_bf16(monkeypatch)
    line = refused(capsys, *QUICK, "engine.mixed_precision=bf16")
    assert "engine.mixed_precision=bf16: this GPU (Tesla K80) cannot compute in bfloat16" in line
    assert line.endswith("this machine runs engine.mixed_precision=no or fp16.")


@pytest.mark.parametrize("args, says", [
    (["engine.mixed_precision=bf16", "model.dtype=bfloat16"], "engine.mixed_precision=bf16 keeps float32 master"),
    (["engine=zero2", "engine.mixed_precision=bf16", "engine.logprob_precision=no"], "engine.logprob_precision=no "
                                                                                      "with DeepSpeed"),
])
def test_mixed_precision_without_float32_master_weights_is_refused(capsys, args, says):
    assert says in refused(capsys, *QUICK, *args)


def test_bf16_on_cpu_and_fp16_on_a_gpu_pass(capsys, monkeypatch, tmp_path):
    from gpo import hardware

    cpu_only(monkeypatch)  # with native bfloat16 (AVX-512): nothing to say
    monkeypatch.setattr(hardware, "this_machine", lambda: hardware.Machine(cuda=False, bf16=True, dynamic_int8=True))
    assert cli.main(["run", "--dry-run", *QUICK, f"output_dir={tmp_path}", "engine.mixed_precision=bf16",
                     "engine.logprob_precision=no"]) == 0
    monkeypatch.undo()
    a_gpu_without_bf16(monkeypatch)
    assert cli.main(["run", "--dry-run", *QUICK, f"output_dir={tmp_path}", "engine.mixed_precision=fp16"]) == 0
    assert capsys.readouterr().err == ""


# --- what still passes ------------------------------------------------------------------------------------------


def test_a_good_config_passes_dry_run_and_config(capsys, tmp_path):
    make_checkpoint(tmp_path / "prev", 2)
    args = ["backend=hf", "tracker=mlflow", f"tracker.uri=sqlite:///{tmp_path}/mlflow.db", f"output_dir={tmp_path}",
            "run_name=prev", "resume=auto", "selector=screen", "selector.n_screen=7", "train.group_size=8",
            "pruner=topk", "pruner.keep=8"]
    assert cli.main(["run", "--dry-run", *args]) == 0
    out, err = capsys.readouterr()
    assert "run_name: prev" in out and "n_screen: 7" in out and err == ""
    assert cli.main(["config", *args]) == 0
    assert capsys.readouterr().out == out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prev"]  # a dry run writes nothing


# --- backend.precision against this machine ------------------------------------------------------------------------


@pytest.mark.parametrize("args, machine, says", [
    # int8 where torch has no dynamic quantisation
    (["backend.precision=int8"], dict(cuda=False, bf16=True, dynamic_int8=False),
     "backend.precision=int8: int8 needs torch's dynamic quantisation"),
    # bf16 in vLLM on a GPU without native bfloat16 (vLLM refuses it there): the line says what does run here
    (["backend=vllm", "backend.precision=bf16"], dict(cuda=True, bf16=False, dynamic_int8=False),
     "backend.precision=bf16: vLLM runs bf16 only on GPUs with native bfloat16 support (compute capability 8.0 or "
     "newer); backend=vllm runs float32, fp16, fp8 on this machine."),
    # fp8 with vLLM on a CPU, refused before vLLM's own absence is
    (["backend=vllm", "backend.precision=fp8"], dict(cuda=False, bf16=True, dynamic_int8=True),
     "backend.precision=fp8: vLLM runs fp8 on CUDA GPUs only; backend=vllm runs float32, bf16 on this machine."),
    (["backend.precision=int8"], dict(cuda=True, bf16=True, dynamic_int8=False), "runs on CPU only"),
])
def test_a_precision_this_machine_cannot_run_is_refused(capsys, monkeypatch, args, machine, says):
    from gpo import hardware

    monkeypatch.setattr(hardware, "this_machine", lambda: hardware.Machine(**machine))
    assert says in refused(capsys, *QUICK, *args)


@pytest.mark.parametrize("args, says", [
    (["backend.precision=fp16"], "`backend.precision` must be one of auto, float32, bf16, int8"),  # hf has no fp16
    (["backend.precision=fp8"], "`backend.precision` must be one of auto, float32, bf16, int8"),
    (["backend=vllm", "backend.precision=int8"], "`backend.precision` must be one of auto, float32, bf16, fp16, fp8"),
])
def test_an_unknown_precision_is_refused_with_the_backends_choices(capsys, args, says):
    assert says in refused(capsys, *QUICK, *args)


def test_gpo_config_runs_the_same_checks(capsys, tmp_path):
    assert cli.main(["config", *QUICK, f"resume={tmp_path / 'nope'}"]) == 2
    assert capsys.readouterr().err.startswith(f"gpo: error: resume={tmp_path / 'nope'}:")


# --- gpo study --help ---------------------------------------------------------------------------------------------


def test_study_help_shows_each_study_setting_with_an_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["study", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(StudyConfig):  # every setting is named, so a new one cannot go unmentioned
        assert f"study.{f.name}=" in text, f.name
    examples = [line for line in text.splitlines() if line.strip().startswith("gpo study ")]
    for key in ("study.seeds=", "study.parallel=", "study.resume=", "study.launcher="):
        assert any(key in line for line in examples), key
