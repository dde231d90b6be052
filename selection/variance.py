"""When a group carries no learning signal (its rewards are equal within a tolerance), and which completions
count as correct.

Group-relative advantages are (r - mean) / (std + eps), so a group whose rewards are all equal trains nothing.
Binary rewards make that exact; for graded rewards (a format bonus, a length penalty) "no variance" means the
spread max - min is at most `tolerance`, the one definition every selector uses.
"""

from __future__ import annotations

from typing import Annotated

from torch import Tensor

from gpo.schema import Gt, Le

# (0, 1]: a share or probability that must leave something (GRESO's p, MoPPS's kept share and decay).
PositiveFraction = Annotated[float, Gt(0), Le(1)]


def no_variance(rewards: Tensor, tolerance: float) -> bool:
    """rewards [n] -> True when max - min <= tolerance (a single reward or none has no variance either)."""
    if rewards.numel() < 2:
        return True
    return float(rewards.max() - rewards.min()) <= tolerance


def successes(rewards: Tensor, threshold: float) -> Tensor:
    """rewards [n] -> bool [n]: completions counted as correct (total reward >= threshold). The default 0.5 reads
    the built-in tasks right: accuracy weighs 1.0 and the format bonus 0.1 or less."""
    return rewards >= threshold


# A selector's pass estimate never goes below this: a step then draws at most 8x the candidates it would draw
# without selection, so one unlucky stretch cannot make the dynamic allocator generate without bound.
PASS_ESTIMATE_FLOOR = 0.125
