"""A tool call and what running it gave, as records: `ToolCall` (one call the model made), `ToolCallError`
(a call that cannot be run: bad JSON, no name, an unknown tool, a missing or unexpected argument, a value
of the wrong type), `ToolResult` (what `execute_tool_call` returns), and the texts the model sees
(`error_text` for a failure, `result_text` for a tool's return value).

A `ToolCallError` is returned in place of the call, never raised at the caller: its text is what the
model sees as the tool's result, so it can correct itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass
class ToolCall:
    """One call the model made. `start`/`end` are character offsets of the whole call in the text."""

    name: str
    arguments: dict
    start: int = 0
    end: int = 0
    raw: str = ""
    id: str | None = None


class ToolCallError(Exception):
    """A call the model made that cannot be run. Returned in place of a `ToolCall`, not raised at the
    caller; `str(error)` is the one-line reason and `result_text` what the model sees as the result."""

    def __init__(self, message: str, name: str | None = None, start: int = 0, end: int = 0, raw: str = ""):
        super().__init__(message)
        self.message = message
        self.name = name
        self.start = start
        self.end = end
        self.raw = raw

    @property
    def result_text(self) -> str:
        return error_text(self.message)

    def __repr__(self) -> str:
        return f"ToolCallError({self.message!r}, name={self.name!r})"


class ToolResult(NamedTuple):
    """What `execute_tool_call` returns: the text the model sees, whether the call failed, its duration."""

    text: str
    failed: bool
    seconds: float


def error_text(message: str) -> str:
    """A failed call's result as the model sees it: TRL's form, `str({"error": message})`."""
    return str({"error": message})


def result_text(result: Any) -> str:
    """A tool's return value as the model sees it: TRL's `str(result)` (a str stays as it is)."""
    return result if isinstance(result, str) else str(result)
