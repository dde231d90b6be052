"""Objectives (`algo=`): how rewards become advantages and log-probs become a loss. One file per paper."""

from gpo.algorithms import dapo, dr_grpo, grpo  # noqa: F401
