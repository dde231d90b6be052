"""gpo: GRPO-family RL training for reasoning models, made cheaper with CPPO completion pruning."""

__version__ = "0.1.0"
