"""Running a tool call: `execute_tool_call` checks it against its tool's schema, then awaits an async
tool or runs a sync one in a thread pool, within a time limit (`DEFAULT_TIMEOUT_S` unless told);
`run_tool_call` does the same for code without an event loop. Nothing the call or the tool does is
raised: a failure is a `ToolResult` whose text the model sees.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
from concurrent.futures import Executor, Future

from cohort_grpo.tools.call_records import ToolCallError, ToolResult, error_text, result_text
from cohort_grpo.tools.call_validation import validate_tool_call
from cohort_grpo.tools.schema import Tool, make_tools

DEFAULT_TIMEOUT_S = 30.0

class DaemonThreads(Executor):
    """Sync tools' calls on at most `workers` daemon threads. A call that never returns keeps its thread (Python
    cannot stop one), so the threads must be daemons: the interpreter waits at exit for a ThreadPoolExecutor's,
    and a run that ended would then hang there forever."""

    def __init__(self, workers: int = 32, name: str = "cohort-tool"):
        self.workers, self.name = workers, name
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.idle = 0
        self.lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        with self.lock:
            self.calls.put((future, fn, args, kwargs))
            if self.idle <= 0 and len(self.threads) < self.workers:
                thread = threading.Thread(target=self.work, name=f"{self.name}_{len(self.threads)}", daemon=True)
                self.threads.append(thread)
                thread.start()
            else:
                self.idle -= 1  # a waiting thread takes this call
        return future

    def work(self) -> None:
        while True:
            future, fn, args, kwargs = self.calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as error:  # noqa: BLE001 - handed to the caller's await
                    future.set_exception(error)
            with self.lock:
                self.idle += 1


_executor: DaemonThreads | None = None


def _tool_executor() -> DaemonThreads:
    global _executor
    if _executor is None:
        _executor = DaemonThreads()
    return _executor


async def execute_tool_call(call, tools, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> ToolResult:
    """Run one call: check it against its tool's schema, then await an async tool or run a sync one in
    a thread pool, at most `timeout_s` seconds (None: no limit). Never raises for anything the call or
    the tool does: returns (text the model sees, failed, seconds).

    `tools` is anything `make_tools` takes; pass `make_tools(tools)` once rather than the functions on
    every call, which would make their schemas again each time.

    A sync tool that overruns its timeout keeps its thread until it returns (Python cannot stop a
    thread); the call is reported as failed at once. Tools that may hang should have their own limit,
    as `run_python` has."""
    start = time.monotonic()
    if isinstance(call, ToolCallError):
        return ToolResult(call.result_text, True, 0.0)
    table = make_tools(tools)
    checked = validate_tool_call(call, table)
    if isinstance(checked, ToolCallError):
        return ToolResult(checked.result_text, True, time.monotonic() - start)
    tool: Tool = table[call.name]
    try:
        if tool.is_async:
            awaitable = tool.function(**call.arguments)
        else:
            loop = asyncio.get_running_loop()
            awaitable = loop.run_in_executor(_tool_executor(), functools.partial(tool.function, **call.arguments))
        value = await asyncio.wait_for(awaitable, timeout_s)
        if asyncio.iscoroutine(value):  # a sync-looking callable that returned a coroutine
            value = await asyncio.wait_for(value, None if timeout_s is None else
                                           max(0.0, timeout_s - (time.monotonic() - start)))
    except asyncio.TimeoutError:
        return ToolResult(error_text(f"tool '{call.name}' timed out after {timeout_s:g} s"), True,
                          time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 - the tool's failure is the model's information, not ours
        detail = str(e).strip()
        message = f"{type(e).__name__}: {detail}" if detail else type(e).__name__
        return ToolResult(error_text(message), True, time.monotonic() - start)
    return ToolResult(result_text(value), False, time.monotonic() - start)


def run_tool_call(call, tools, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> ToolResult:
    """`execute_tool_call` for code without an event loop (it runs one)."""
    return asyncio.run(execute_tool_call(call, tools, timeout_s))
