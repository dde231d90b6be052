"""Field types for config dataclasses: ranges and choices that `gpo.config.compose` checks before anything loads.

A config field says what it accepts in its annotation, and the composer enforces it with the same messages for
every section and every component (plug-ins included):

    loss_agg: Literal["seq_mean", "token_mean"] = "seq_mean"   # a choice: a typo gets a did-you-mean
    beta: NonNegative = 0.04                                   # a range: -0.1 is refused with the bound
    rate: Rate = 0.5                                           # 0 <= rate < 1
    steps: Annotated[int, Ge(1)] = 12                          # any annotated_types bound works

Config dataclasses are frozen (`@dataclass(frozen=True)`), with tuples for sequences, so a validated run config
cannot be changed behind the composer's back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from annotated_types import Ge, Gt, Le, Lt
from pydantic import AfterValidator

PositiveInt = Annotated[int, Ge(1)]
NonNegativeInt = Annotated[int, Ge(0)]
Positive = Annotated[float, Gt(0)]
NonNegative = Annotated[float, Ge(0)]
Rate = Annotated[float, Ge(0), Lt(1)]  # a fraction that leaves something: pruning rates, drop rates
Fraction = Annotated[float, Ge(0), Le(1)]  # a probability or share, both ends allowed


def _existing_dir(value: str) -> str:
    if not Path(value).expanduser().is_dir():
        what = "is a file, not a directory" if Path(value).expanduser().exists() else "does not exist"
        raise ValueError(f"`{value}` {what}. Point it at an existing local directory (relative paths are read "
                         "from the directory gpo runs in), or leave it unset.")
    return value


# A local directory that must exist when the config is composed (a task's data_dir), kept as the text given:
# a typo fails `--dry-run` instead of the first read, after the model has loaded.
ExistingDir = Annotated[str, AfterValidator(_existing_dir)]

__all__ = ["ExistingDir", "Fraction", "Ge", "Gt", "Le", "Lt", "NonNegative", "NonNegativeInt", "Positive",
           "PositiveInt", "Rate"]
