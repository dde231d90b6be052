"""CPPO completion pruners (`pruner=`): which completions get a log-prob forward pass."""

from gpo.pruners import none  # noqa: F401
