"""One study run in its own process, both sides: `run_child` starts `python -m gpo.study --child SPEC` and reads its
`Outcome`; `child` runs inside that process, trains, then writes the outcome and the process's peak memory."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from gpo.run_config import RunConfig


def child(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    # Plug-ins the study could import (e.g. added to sys.path by the caller) must import here too. Appended, never
    # prepended: the caller's path may end in folders such as setuptools/_vendor (added by importing setuptools),
    # whose old vendored copies would otherwise shadow the real packages in site-packages.
    extra = [p for p in spec["sys_path"] if p not in sys.path]
    sys.path.extend(extra)
    status, error, ranks = "FAILED", "", False
    try:
        from omegaconf import OmegaConf

        from gpo.config import validate

        cfg = validate(cast(dict[str, Any], OmegaConf.to_container(OmegaConf.create(spec["config"]), resolve=True)))
        ranks = cfg.engine.num_processes > 1
        code = _run(cfg, extra)
        status, error = ("FINISHED", "") if code == 0 else ("FAILED", f"a rank exited with status {code}")
    except KeyboardInterrupt:
        status, error = "KILLED", "interrupted"
    except BaseException as exc:  # reported in the table; the traceback goes to the run's log
        import traceback

        traceback.print_exc()
        text = str(exc).strip()
        error = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
    Path(spec["result"]).write_text(json.dumps(
        {"status": status, "error": error, "peak_rss_mb": _peak_rss_mb(ranks), "peak_gpu_mb": _peak_gpu_mb()}))
    return 0 if status == "FINISHED" else 1


def _run(cfg, extra_path: list[str]) -> int:
    """The run through `gpo run`'s own path (gpo.launch.run): in this process, or as `gpo run --config RESOLVED.yaml`
    on every rank under accelerate launch. The ranks find the study's plug-ins through PYTHONPATH; folders inside an
    installation (site-packages, such as setuptools/_vendor) are left out, since PYTHONPATH would put their old
    vendored copies before the real packages."""
    import os

    from gpo import launch
    from gpo.config import layer_yaml

    own = [p for p in extra_path if "site-packages" not in p and "dist-packages" not in p]
    if own:
        os.environ["PYTHONPATH"] = os.pathsep.join([*own, *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="gpo-study-run-", delete=False) as f:
        f.write(layer_yaml(cfg))
    try:
        return launch.run(cfg, ["--config", f.name])
    finally:
        Path(f.name).unlink(missing_ok=True)


def _peak_rss_mb(ranks: bool) -> float | None:
    """This process's peak resident memory; with ranks, the largest rank's (the biggest finished child)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_CHILDREN if ranks else resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def _peak_gpu_mb() -> float | None:
    torch = sys.modules.get("torch")  # never import torch just to ask
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


# --- the study's side: start a child and read its outcome ---------------------------------------------------


@dataclass
class Outcome:
    status: str  # FINISHED | FAILED | KILLED
    error: str  # first line of the failure, "" when it finished
    peak_rss_mb: float | None
    peak_gpu_mb: float | None


def run_child(cfg: RunConfig, run_dir: Path, devices: list[int] | None = None,
              sys_path: list[str] | None = None) -> tuple[Outcome, Path]:
    """Train one run in a fresh interpreter; its stdout and stderr go to `<run_dir>/study.log`. `sys_path`: the
    study's import path (where its plug-ins are found), when this runs elsewhere (a Ray worker)."""
    import os

    from gpo.config import to_yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    log_path, spec_path, result_path = run_dir / "study.log", run_dir / "study-spec.json", run_dir / "study-result.json"
    spec = {"config": to_yaml(cfg), "result": str(result_path), "sys_path": [p for p in sys_path or sys.path if p]}
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpo.study", "--child", str(spec_path)], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C reached the child too: let it save its checkpoint and end its run
            proc.wait()
            raise
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        outcome = Outcome(result["status"], result["error"], result["peak_rss_mb"], result["peak_gpu_mb"])
        return outcome, log_path
    last = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-1:]
    why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    error = f"the run's process ended without a result ({why}){': ' + last[0] if last else ''}"
    return Outcome("FAILED", error, None, None), log_path
