"""User-facing errors.

A `CohortError` is a problem with the user's input (a path, a config value, a data file).
The CLI prints its message as one line and exits non-zero without a traceback; the
message must name the offending input and say how to fix it.

A message names options as the command line writes them (`pass --resume`); the `cohort-grpo` command runs
inside `command_line()` and shows it so. Anywhere else the reader called `GRPOConfig(...)` or
`GRPOTrainer(...)` from Python, and the message is shown with the keywords written there (`pass
resume=True`, cohort_grpo/config/spelling.py). The rewrite happens when the message is shown, not when it is
raised, so a message built from another one, or raised on another thread, follows the same rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

_front_end = {"command_line": False}  # one front end per process: a flag, not a contextvar threads would miss
_python_spelling: list[Callable[[str], str]] = []  # the config's rewrite of `--option value` spans


class CohortError(Exception):
    """Bad input: printed as one line by the CLI, never with a traceback (unless --debug)."""

    def __str__(self) -> str:
        return super().__str__() if self.from_command_line else in_front_end_words(super().__str__())

    from_command_line = False  # set when it leaves `command_line()`: a --debug traceback keeps the flags


def in_front_end_words(text: str) -> str:
    """`text`, written with the command line's flags, as the front end running now names the options."""
    if _front_end["command_line"] or not _python_spelling:
        return text
    return _python_spelling[0](text)


def spell_for_python(rewrite: Callable[[str], str]) -> None:
    """How a message's options are written for a Python caller (`cohort_grpo.config.spelling.python_spelling`)."""
    _python_spelling[:] = [rewrite]


@contextlib.contextmanager
def command_line():
    """Within it, and for the errors raised through it, `CohortError` messages keep the command line's flag
    names (`--resume`). Usable as a decorator."""
    before = _front_end["command_line"]
    _front_end["command_line"] = True
    try:
        yield
    except CohortError as error:
        error.from_command_line = True
        raise
    finally:
        _front_end["command_line"] = before
