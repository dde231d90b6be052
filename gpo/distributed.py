"""Multi-rank helpers on torch.distributed (gloo or NCCL); each is a no-op when no process group is running.

The engine's layout (docs/architecture.md, "The step"): every rank generates its share of a step's questions,
`all_gather_batch` gives every rank the same full batch, pruners decide on it identically everywhere and round a
varying kept count (threshold pruning) up to a multiple of the world size by their own score
(`Pruner.keep(batch, multiple_of)`), and `shard` splits the kept rows evenly, so every rank trains on the same
number of rows and `group`/`global` pruning ignores the world size.

When a rank dies or hangs, the others fail in their next collective: at once when the dead peer's sockets close
(gloo), or after engine.collective_timeout_s when it stops answering. `peer_failures_explained` turns that failure
into a `PeerLost` message (what happened, how to continue) instead of a backend traceback; the launcher then stops
every rank (gpo/launch.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpo.errors import UserError
from gpo.types import RolloutBatch


class PeerLost(UserError):
    """Another rank died or stopped answering during a collective. Not the user's mistake, but reported the same
    way, as one message without a traceback: the cause is outside this process (the other rank's log says it)."""


@contextmanager
def peer_failures_explained(how_to_continue: Callable[[], str]) -> Iterator[None]:
    """Re-raise a failed collective (gloo or NCCL) as `PeerLost`, naming this rank and `how_to_continue()`."""
    try:
        yield
    except PeerLost:
        raise
    except RuntimeError as exc:
        if not _from_collective(exc):
            raise
        rank, world_size = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        cause = _first_sentence(str(exc)) or type(exc).__name__
        raise PeerLost(
            f"rank {rank} of {world_size}: a collective operation with the other ranks failed ({cause}). Another "
            f"rank most likely died (killed, out of memory) or hung past engine.collective_timeout_s; its own log "
            f"says why, and the launcher's report names the first rank that failed. {how_to_continue()}".strip()
        ) from exc


def _from_collective(exc: RuntimeError) -> bool:
    """True for a communication failure: torch's DistError family (NCCL, timeouts of the store) and the plain
    RuntimeErrors gloo raises, which name their gloo source file (also from DDP's all-reduce inside backward)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in ("gloo", "nccl", "connection closed by peer", "connection reset by peer"))


def _first_sentence(message: str) -> str:
    """A backend message without its source location prefix (`[.../pair.cc:537] `) and its boilerplate advice."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", message.strip().splitlines()[0] if message.strip() else "")
    return text.split(". ")[0].rstrip(".")


def free_port() -> int:
    """A port nobody listens on now, so two multi-process runs on one machine do not collide on the default."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world() -> tuple[int, int]:
    """(rank, world_size); (0, 1) without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(x: Tensor | float | int) -> Tensor | float | int:
    """The sum of x over ranks (a new tensor, or a number of x's type)."""
    _, world_size = world()
    if world_size == 1:
        return x.clone() if isinstance(x, Tensor) else x
    t = x.clone() if isinstance(x, Tensor) else torch.tensor(x, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    if isinstance(x, Tensor):
        return t
    return type(x)(t.item())


def from_rank_zero(value: Any) -> Any:
    """Rank 0's `value` on every rank (a picklable object); `value` itself on one process. For what each rank
    would otherwise compute for itself and might get differently, such as a run name holding the start time:
    every rank's checkpoint files must land in the same directory."""
    if world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=_device())
    return box[0]


def all_reduce_values(values: dict[str, float], op: str = "sum") -> dict[str, float]:
    """Each value reduced over ranks ("sum", "min" or "max") in one collective; a copy on one process.
    Every rank must pass the same keys (the engine's step metrics: same code, same global totals)."""
    _, world_size = world()
    if world_size == 1 or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return dict(zip(keys, t.tolist()))


def all_gather_batch(batch: RolloutBatch, pad_token_id: int) -> RolloutBatch:
    """Every rank's batch, concatenated in rank order, on every rank.

    Widths are padded to the widest rank (prompts on the left, completions on the right), group ids are offset so
    each question stays distinct, and `owner_rank` is set to the rank that generated the row.
    """
    rank, world_size = world()
    if world_size == 1:
        return dataclasses.replace(batch, owner_rank=torch.zeros(len(batch), dtype=torch.long))
    device = batch.completion_ids.device
    # Row counts and widths may differ between ranks: share them, then pad every tensor to the largest.
    shape = torch.tensor([len(batch), batch.prompt_ids.shape[1], batch.completion_ids.shape[1]], device=device)
    shapes = torch.stack(_gather(shape)).cpu()  # [world, 3]
    rows, widths = shapes[:, 0].tolist(), {"prompt": int(shapes[:, 1].max()), "completion": int(shapes[:, 2].max())}

    def gather_tensor(x: Tensor, left: bool, pad: float) -> list[Tensor]:
        if x.dtype == torch.bool:  # gloo has no bool all_gather; travel as uint8
            return [p.bool() for p in gather_tensor(x.to(torch.uint8), left, pad)]
        if x.dim() == 2:
            width = widths["prompt" if left else "completion"]
            extra = width - x.shape[1]
            x = torch.nn.functional.pad(x, (extra, 0) if left else (0, extra), value=pad)
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, max(rows) - len(x)))  # pad rows at the end
        return [part[:n] for part, n in zip(_gather(x), rows)]

    def gather_field(x: Tensor | None, left: bool, pad: float) -> list[Tensor] | None:
        return None if x is None else gather_tensor(x, left, pad)

    parts: dict[str, list[Tensor] | None] = {}
    for f in dataclasses.fields(RolloutBatch):
        if f.name == "reward_components":
            continue
        value = getattr(batch, f.name)
        if f.name in ("old_logprobs", "ref_logprobs", "generator_logprobs", "is_weights", "is_mask", "loss_mask",
                      "versions", "tool_tokens"):
            _require_same_presence(value is not None, f.name)
        parts[f.name] = gather_field(value, left=f.name.startswith("prompt"),
                                     pad=pad_token_id if f.name.endswith("_ids") else 0)
    components = {name: gather_tensor(batch.reward_components[name], False, 0)
                  for name in sorted(batch.reward_components)}
    # Any: one rank's fields, the required tensors and the optional log-probs (None where no rank has them).
    fields: list[dict[str, Any]] = [{name: (None if p is None else p[r]) for name, p in parts.items()}
                                    for r in range(world_size)]
    per_rank = [
        RolloutBatch(**fields[r], reward_components={name: c[r] for name, c in components.items()})
        for r in range(world_size)
    ]
    for r, b in enumerate(per_rank):
        b.owner_rank = torch.full((len(b),), r, dtype=torch.long, device=device)  # [N_r]
    return RolloutBatch.concat(per_rank, pad_token_id=pad_token_id)


def shard(kept: RolloutBatch, rank: int, world_size: int) -> RolloutBatch:
    """This rank's contiguous, equal share of the kept rows (rows stay in order, every field with them, the loss mask
    included; padding re-trimmed)."""
    n = len(kept)
    if n % world_size:
        raise UserError(
            f"{n} kept completions cannot be split evenly over {world_size} ranks: the step's candidates (its "
            f"questions x group size, after the group filter) must be a multiple of {world_size}. Make "
            f"train.group_size or train.questions_per_step a multiple of {world_size}."
        )
    share = n // world_size
    return kept.select(torch.arange(rank * share, (rank + 1) * share, device=kept.completion_ids.device))


def _gather(x: Tensor) -> list[Tensor]:
    """all_gather on the backend's device (NCCL needs CUDA tensors, gloo takes CPU ones), returned on x's device."""
    moved = x.to(_device()).contiguous()
    out = [torch.empty_like(moved) for _ in range(world()[1])]
    dist.all_gather(out, moved)
    return [o.to(x.device) for o in out]


def _require_same_presence(present: bool, name: str) -> None:
    """All ranks must agree whether an optional field exists, or the collectives would deadlock."""
    flags = _gather(torch.tensor([int(present)], device=_device()))
    if len({int(f) for f in flags}) > 1:
        raise UserError(f"all_gather_batch: `{name}` is set on some ranks and not on others.")


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
