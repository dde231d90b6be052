"""Inside one study run's own process (`python -m gpo.study --child SPEC`): train, then write the outcome and this
process's peak memory where the study reads them."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, cast


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
