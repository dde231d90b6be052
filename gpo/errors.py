"""The one exception type that means "the user asked for something invalid".

The CLI turns a `UserError` into a one-paragraph message and exit code 2; anything else is a bug in gpo
(exit code 1, with a traceback so it can be reported).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable


class UserError(Exception):
    """A bad config, argument or input file: the message says what is wrong and how to fix it."""


def print_user_error(exc: UserError) -> None:
    """The one line a UserError prints, without a traceback (its process then exits with status 2)."""
    print(f"gpo: error: {exc}", file=sys.stderr, flush=True)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean `x`?' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean `{close[0]}`?" if close else ""
