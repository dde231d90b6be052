"""k, the completions kept per group of G, from a pruning rate P or an explicit count.

One rule shared by the pruners that keep k per group (topk, random) and by the dynamic allocator, which sizes a
step by the same k: both must get the same integer, so it lives here, where neither depends on the other.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from gpo.errors import UserError


def kept_per_group(group_size: int, rate: float | None = None, keep: int | None = None) -> int:
    """k, the completions kept per group of `group_size`: `keep` if given, else G - round(G*P) (half rounds up).

    The caller passes `keep` or a `rate` in [0, 1): the config's annotations and the `__post_init__` of
    `gpo.pruners.ranking.QuotaConfig` check both when it is composed. What depends on G is checked here: a k outside
    1..G is a UserError, never truncated (P = 1 would keep 0).
    G*P is computed on the rate as written, in decimal: in binary floating point 50 * 0.29 is 14.4999..., which
    rounds to 14 where the rule gives round(14.5) = 15. `str(rate)` is the shortest decimal that reads back as
    the same float, i.e. what the user wrote.
    """
    if keep is not None:
        k = keep
        what = f"keep={keep}"
    else:
        pruned = (group_size * Decimal(str(rate))).quantize(Decimal(1), rounding=ROUND_HALF_UP)
        k = group_size - int(pruned)
        what = f"rate={rate} (k = {group_size} - round({group_size}*{rate}) = {k})"
    if not 0 < k <= group_size:
        raise UserError(
            f"{what} keeps {k} of a group of {group_size}; it must keep between 1 and {group_size}. "
            f"Choose a smaller rate or a keep in 1..{group_size}."
        )
    return k
