"""Objectives (`algo=`): how rewards become advantages and log-probs become a loss. One file per paper."""
