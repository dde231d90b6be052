"""`gpo run ... engine.num_processes=N`: start N ranks under `accelerate launch` running the same command.

The launched processes see WORLD_SIZE (set by torch's elastic launcher), so they train instead of launching
again; `accelerate launch -m gpo run ...` by hand reaches the same place. On CPU the ranks talk over gloo: the
launcher gets `--multi_gpu` (its only multi-process mode besides DeepSpeed; `--cpu` would start a single
process) with ACCELERATE_USE_CPU=true, and DeepSpeed gets DS_ACCELERATOR=cpu. On GPUs it is one process per
device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import NoReturn

import torch

from gpo.distributed import PeerLost, free_port
from gpo.errors import UserError, print_user_error
from gpo.hardware import mixed_precision
from gpo.run_config import EngineConfig, RunConfig


def launched() -> bool:
    """True inside a rank started by a distributed launcher (accelerate launch, torchrun, deepspeed)."""
    return "WORLD_SIZE" in os.environ


def needs_launch(engine: EngineConfig) -> bool:
    return engine.num_processes > 1 and not launched()


def command(engine: EngineConfig, gpo_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The `accelerate launch` command line and environment that run `gpo run gpo_args` on every rank."""
    n = engine.num_processes
    env = dict(os.environ)
    cpu = not torch.cuda.is_available()
    if not cpu and torch.cuda.device_count() < n:
        raise UserError(f"engine.num_processes={n} asks for one process per GPU, but only "
                        f"{torch.cuda.device_count()} GPU(s) are visible.")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1",
              "--mixed_precision", mixed_precision(engine.mixed_precision), "--dynamo_backend", "no",
              "--main_process_port", str(free_port())]
    if engine.deepspeed_stage:
        launch += ["--use_deepspeed", "--zero_stage", str(engine.deepspeed_stage)]
        if cpu:
            env["DS_ACCELERATOR"] = "cpu"
    else:
        launch.append("--multi_gpu")
        if cpu:
            env["ACCELERATE_USE_CPU"] = "true"
    return [*launch, "-m", "gpo", "run", *gpo_args], env


def run(cfg: RunConfig, gpo_args: list[str]) -> int:
    """What `gpo run` does with a composed config, also used by each study run: train here, or start
    engine.num_processes ranks that each run `gpo run gpo_args` (arguments that compose the same config)."""
    if needs_launch(cfg.engine):
        return relaunch(cfg.engine, gpo_args)
    from gpo.engine import train

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        train(cfg)
        return 0
    try:
        train(cfg)
    except PeerLost as exc:
        # Freeing the DDP module joins gloo's threads, which still wait on the lost peer: without this exit the
        # rank would hang, and the launcher, waiting for it, would never stop the rank that hung.
        print_user_error(exc)
        _end_rank(2)
    _end_rank(0)


def _end_rank(status: int) -> NoReturn:
    """End a rank without the interpreter's teardown. A finished rank (saved, tracker ended, process group
    destroyed): native threads of DeepSpeed's ZeRO-3 offload can abort it ("terminate called without an active
    exception"), and the launcher would then report a finished run as failed. A rank that lost its peer: see
    `run`."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def relaunch(engine: EngineConfig, gpo_args: list[str]) -> int:
    """Run the ranks and wait; the exit status is the launcher's (non-zero if any rank failed).

    When one rank fails (an error, a kill, out of memory), the launcher stops the others (SIGTERM, then SIGKILL
    after 30 s) and reports the first failure; the ranks that lost their peer say so themselves, with how to
    continue (gpo.distributed.PeerLost). This adds one line that points at both."""
    cmd, env = command(engine, gpo_args)
    print(f"gpo: launching {engine.num_processes} processes: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    status = subprocess.call(cmd, env=env)
    if status != 0:
        print(f"gpo: the {engine.num_processes}-process run failed (launcher exit status {status}). The launcher's "
              f"report above names the first rank that failed (\"Root Cause\"); every rank's own message is above "
              f"it. To continue from the newest complete checkpoint, rerun the same command with resume=auto and "
              f"the same run_name.", file=sys.stderr, flush=True)
    return status

