"""Objectives (`algo=`): how rewards become advantages and log-probs become a loss. One file per paper; base.py holds
what they share (the common settings and GRPO's parts)."""

from gpo.algorithms import cispo, dapo, dr_grpo, gmpo, grpo, gspo, reinforce_pp, rloo, sapo  # noqa: F401
