"""Question selectors (`selector=`): which questions get rollouts at all, decided before generation."""

from gpo.selectors import greso, mopps, none, screen  # noqa: F401
