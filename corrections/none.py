"""`none`: no correction. The mismatch metrics are still logged wherever the backend reports its log-probs."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from gpo.corrections.ratios import unchanged
from gpo.registry import register
from gpo.types import Corrected


@dataclass(frozen=True)
class NoneConfig:
    pass


@register("correction", "none", config=NoneConfig)
class NoCorrection:
    """No correction: weight 1 on every token; the mismatch is only measured."""

    masks = False

    def __init__(self, cfg: NoneConfig) -> None:
        self.cfg = cfg

    def correct(self, old_logprobs: Tensor, generator_logprobs: Tensor, loss_mask: Tensor) -> Corrected:
        return unchanged(loss_mask)
