"""Test-only tools (`task.tools=[gpo_toolbox:echo]`) and environments (`task.environment=gpo_toolbox:Guess`): well
behaved ones, and ones that raise, hang, crash or cannot be described, for tests/unit/test_tools.py and
test_environments.py. Imports only the standard library, so a tool worker starts quickly."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

RELEASE = threading.Event()  # set by a test to let an abandoned environment method return


# --- tools ------------------------------------------------------------------------------------------------------


def echo(text: str, times: int = 1) -> str:
    """Repeats a text.

    Args:
        text: The text to repeat.
        times: How many times to repeat it.
    """
    return text * times


echo_again = echo  # a second spec for the same function: its name collides


def add(a: int, b: float) -> float:
    """Adds two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def pick(options: list[int], mode: str | None = None) -> dict:
    """Picks the largest option.

    Args:
        options: The numbers to pick from.
        mode: Unused.
    """
    return {"picked": max(options), "mode": mode}


async def shout(text: str) -> str:
    """Shouts a text.

    Args:
        text: The text to shout.
    """
    return text.upper()


def fail(message: str) -> str:
    """Raises.

    Args:
        message: The exception's message.
    """
    raise ValueError(message)


def leave() -> str:
    """Calls sys.exit, which a tool must not be able to end its worker with."""
    raise SystemExit(4)


def give_set() -> set:
    """Returns something that is not text."""
    return {1, 2}


def give_none() -> None:
    """Returns nothing."""


def spin() -> str:
    """Computes forever."""
    while True:
        pass


def nap() -> str:
    """Waits forever without computing."""
    while True:
        time.sleep(3600)


def die(code: int) -> str:
    """Ends its process at once, as a crash in C code would.

    Args:
        code: The exit status.
    """
    os._exit(code)


def kill_self() -> str:
    """Its process is killed by a signal."""
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


def undocumented(x: int) -> str:
    return str(x)


def unhinted(x) -> str:
    """Lacks a type hint.

    Args:
        x: A value.
    """
    return str(x)


def no_args_section(x: int) -> str:
    """Describes itself but not its argument."""
    return str(x)


def star(*values: int) -> str:
    """Takes any number of values.

    Args:
        values: The values.
    """
    return str(values)


NOT_A_FUNCTION = 42


# --- environments -----------------------------------------------------------------------------------------------


class Guess:
    """Guess a hidden number from higher/lower replies."""

    def __init__(self) -> None:
        self.secret = 0
        self.guesses = 0
        self.solved = False

    def reset(self, secret: int) -> str:
        self.secret = secret
        return "I am thinking of a number."

    def guess(self, number: int) -> str:
        """Checks a guess against the hidden number.

        Args:
            number: The guess.
        """
        self.guesses += 1
        if number == self.secret:
            self.solved = True
            return "right"
        return "higher" if number < self.secret else "lower"

    def hint(self) -> dict:
        """Returns how many guesses were made so far."""
        return {"guesses": self.guesses}

    def explode(self, why: str) -> str:
        """Raises.

        Args:
            why: The message.
        """
        raise RuntimeError(why)

    def stall(self) -> str:
        """Computes until the test releases it."""
        while not RELEASE.is_set():
            pass
        return "released"

    def numbers(self) -> set:
        """Returns something that is not text."""
        return {self.secret}

    def respond(self, message: str) -> str | None:
        return None if self.solved else f"Not yet: you said {message!r}."

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0

    def close(self) -> None:
        pass

    @property
    def state(self) -> str:  # a property is no tool
        return "solved" if self.solved else "open"


class Quiet:
    """No respond, no get_reward; reset takes every column."""

    def reset(self, **row: object) -> None:
        self.row = row


class Broken:
    """reset, respond and get_reward that go wrong, picked by the row."""

    def reset(self, how: str) -> object:
        self.how = how
        if how == "raise":
            raise KeyError("no board")
        return 5 if how == "number" else None

    def respond(self, message: str) -> object:
        return 3

    def get_reward(self) -> float:
        return math.nan if self.how == "nan" else True


class NoReset:
    def guess(self, number: int) -> str:
        """Checks a guess.

        Args:
            number: The guess.
        """
        return str(number)


class NeedsArguments:
    def __init__(self, size: int) -> None:
        self.size = size

    def reset(self) -> None:
        pass


class UndocumentedTool:
    def reset(self) -> None:
        pass

    def move(self, x: int) -> str:
        return str(x)


class BadRespond:
    def reset(self) -> None:
        pass

    def respond(self) -> str:
        return "?"
