"""CPPO completion pruners (`pruner=`): which completions get a log-prob forward pass."""

from gpo.pruners import none, random, threshold, topk  # noqa: F401
