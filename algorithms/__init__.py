"""Objectives (`algo=`): how rewards become advantages and log-probs become a loss. One file per paper."""

from gpo.algorithms import cispo, dapo, dr_grpo, gmpo, grpo, gspo, reinforce_pp, rloo, sapo  # noqa: F401
