"""Calling a user's function (a reward function, a tool): with only the keyword arguments it takes
(`accepted_kwargs`), in a daemon thread with a time limit (`call_in_thread`), and its exception told in one line
(`exception_line`)."""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Callable


def accepted_kwargs(func: Callable, kwargs: dict) -> dict:
    """All of `kwargs` for a function with **kwargs (TRL's convention); else only the names it takes."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def call_in_thread(func: Callable, kwargs: dict, timeout_s: float, name: str) -> dict | None:
    """`func(**kwargs)` in a daemon thread (awaited there when it is async): {"values": ...} or {"error": exception};
    None if it is still running after `timeout_s` (Python cannot stop it: it runs on in the background)."""
    box: dict = {}

    def target():
        try:
            value = func(**kwargs)
            # an async function (TRL awaits them): run to its end on this thread's own event loop
            box["values"] = asyncio.run(value) if inspect.iscoroutine(value) else value
        except BaseException as e:  # noqa: BLE001 — any failure of user code is reported, not raised here
            box["error"] = e

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s))
    return None if thread.is_alive() else box


def exception_line(error: BaseException | str) -> str:
    """`Type: message`, the message cut to its last line (as a traceback's last line): one line.
    Also takes the "Type: message" text a worker process reports."""
    if isinstance(error, BaseException):
        kind, message = type(error).__name__, str(error)
    else:
        kind, _, message = str(error).partition(":")
        kind, message = (kind.strip(), message) if message else ("Exception", kind)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    text = f"{kind}: {lines[-1]}" if lines else kind
    return text if len(text) <= 300 else text[:300] + "…"
