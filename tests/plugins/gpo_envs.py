"""Test-only environments (TRL's convention: `reset(**row)`, public methods are tools, optional `get_reward`),
loaded by spec as a user's would be: `task.environment=gpo_envs:GuessNumber`."""

from __future__ import annotations

import re


class GuessNumber:
    """Guess a hidden number: each model turn names one, the environment answers `higher` or `lower` as the next
    user turn, and ends the episode (None) on the right one. Reward 1 when found."""

    def reset(self, answer, **row) -> str:
        self.target, self.found, self.guesses = int(answer), False, 0
        return "I am thinking of a number from 1 to 16. Say one number per turn."

    def respond(self, message: str) -> str | None:
        numbers = re.findall(r"-?\d+", message)
        if not numbers:
            return "Say a number."
        self.guesses += 1
        guess = int(numbers[-1])
        if guess == self.target:
            self.found = True
            return None
        return "higher" if guess < self.target else "lower"

    def get_reward(self) -> float:
        return 1.0 if self.found else 0.0


class Counter:
    """An environment whose tool changes the episode's state; the reward reads it."""

    def reset(self, **row) -> None:
        self.total = 0

    def add(self, k: int) -> str:
        """Add a number to the running total.

        Args:
            k: The number to add.
        """
        self.total += k
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total)


class NoReset:
    """Not an environment: it has no `reset`."""

    def add(self, k: int) -> str:
        """Add.

        Args:
            k: The number.
        """
        return str(k)


class Undocumented:
    def reset(self, **row) -> None:
        pass

    def peek(self, k):
        return str(k)
