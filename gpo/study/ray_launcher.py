"""`study.launcher=ray`: every run of a study as a Ray task, scheduled by the cluster's own resource manager.

Ray (https://docs.ray.io) is an existing engine researchers already run on GPU clusters (KubeRay, the Slurm and
cloud launchers of `ray up`), so gpo adds no scheduler of its own: each run is one task that reserves
`study.cpus_per_run` CPUs and, on a cluster with GPUs, engine.num_processes GPUs (Ray then sets
CUDA_VISIBLE_DEVICES for it). The task starts the same run process as the local launcher, so a run behaves, logs
and records identically however it was launched. Every run is submitted at once and Ray decides how many run
together (study.parallel is not used). `study.ray_address` joins an existing cluster (e.g. `auto` on a cluster
node); without it a local Ray instance is started on this machine.

On a multi-node cluster the study directory (output_dir) must be on a file system every node shares, and the
MLflow store should be a server every node reaches (`tracker.uri=http://...`), not the default SQLite file.
Install with `pip install 'gpo[ray]'`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpo.errors import UserError
from gpo.run_config import as_dict


def _run_on_worker(config: dict, run_dir: str, sys_path: list[str]) -> tuple[Any, Path]:
    """On a Ray worker: the study's import path first (plug-ins the config names), then the run's own process."""
    import sys

    sys.path.extend(p for p in sys_path if p not in sys.path)  # appended: see gpo.study.child on vendored copies
    from gpo.config import validate
    from gpo.study.child import run_child

    return run_child(validate(config), Path(run_dir), sys_path=sys_path)


def require() -> Any:
    """The `ray` module, or a UserError saying how to install it (checked before a study directory is made)."""
    try:
        import ray
    except ImportError:
        raise UserError("study.launcher=ray needs Ray: pip install 'gpo[ray]' (or pip install ray).") from None
    return ray


def run_all(runs: list, configs: dict[int, Any], options: Any) -> Iterator[tuple[Any, Any, Path]]:
    """Yield (run, outcome, log path) as the Ray tasks finish."""
    ray = require()
    if not ray.is_initialized():
        ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=False)
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    task = ray.remote(_run_on_worker)
    pending = {}
    for run in runs:
        cfg = configs[run.index]
        resources = {"num_cpus": options.cpus_per_run, "num_gpus": int(cfg.engine.num_processes) if gpus else 0}
        ref = task.options(**resources).remote(as_dict(cfg),
                                               str(Path(cfg.output_dir) / cfg.run_name), list(sys.path))
        pending[ref] = run
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                outcome, log = ray.get(ref)
                yield pending.pop(ref), outcome, log
    except KeyboardInterrupt:
        for ref in pending:
            ray.cancel(ref)
        raise
