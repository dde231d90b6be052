"""Inside one study run's own process (`python -m gpo.study --child SPEC`): train, then write the outcome and this
process's peak memory where the study reads them."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


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

        from gpo import launch, registry
        from gpo.config import section, validate

        cfg = OmegaConf.create(spec["config"])
        registry.load_builtins()
        registry.load_plugins([str(m) for m in cfg.get("plugins") or []])
        cfg = validate(cfg)
        engine = section(cfg, "engine")
        if launch.needs_launch(engine):  # several ranks: `gpo run` under accelerate launch, as a user would
            ranks = True
            code = _launch_ranks(cfg, engine, extra)
            status, error = ("FINISHED", "") if code == 0 else ("FAILED", f"a rank exited with status {code}")
        else:
            from gpo.engine import train

            train(cfg)
            status = "FINISHED"
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


def rank_config(cfg) -> dict:
    """The resolved config as a `gpo run --config` file: it names each component in `defaults:`, so the composer
    picks the same components before the resolved sections are laid over them."""
    from omegaconf import OmegaConf

    from gpo.config import COMPONENT_GROUPS

    body = OmegaConf.to_container(cfg, resolve=True)
    body["defaults"] = {kind: body[kind]["name"] for kind in COMPONENT_GROUPS}
    return body


def _launch_ranks(cfg, engine, extra_path: list[str]) -> int:
    """`gpo run --config RESOLVED.yaml` on every rank, under accelerate launch. The ranks find the study's
    plug-ins through PYTHONPATH; folders inside an installation (site-packages, such as setuptools/_vendor) are
    left out, since PYTHONPATH would put their old vendored copies before the real packages."""
    import os

    from omegaconf import OmegaConf

    from gpo import launch

    own = [p for p in extra_path if "site-packages" not in p and "dist-packages" not in p]
    if own:
        os.environ["PYTHONPATH"] = os.pathsep.join([*own, *filter(None, [os.environ.get("PYTHONPATH")])])

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="gpo-study-run-", delete=False) as f:
        OmegaConf.save(OmegaConf.create(rank_config(cfg)), f.name)
    try:
        return launch.relaunch(engine, ["--config", f.name])
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
