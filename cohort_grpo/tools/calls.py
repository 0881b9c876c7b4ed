"""Tool calls in a model family's text format: parse, detect while generating, execute, render results.

Text in, structured out; nothing here knows about tokens. Two families:

* "hermes" (Qwen2.5, Qwen3, Hermes, and most templates that use these tags): one or more
  `<tool_call>\\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\\n</tool_call>` blocks in the turn,
  possibly after some text.
* "llama3" (Llama 3.1, 3.2, 3.3 JSON tool calling): the whole message is
  `{"name": "multiply", "parameters": {"a": 3, "b": 4}}`, optionally after `<|python_tag|>`.

A call that cannot be used (bad JSON, no name, an unknown tool, a missing or unexpected argument, a
value of the wrong type) is a `ToolCallError`, returned in place of the call, never raised at the
caller: its text is what the model sees as the tool's result, so it can correct itself.

    calls = parse_tool_calls(text, "hermes", tools)             # [ToolCall | ToolCallError, ...]
    call = detect_tool_call(text_so_far, "hermes")              # None until a call is complete
    text, failed, seconds = await execute_tool_call(call, tools, timeout_s=10)
    messages += [assistant_message(calls), *tool_result_messages(call, text)]
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cohort_grpo.tools.schema import Tool, make_tools

FAMILIES = ("hermes", "llama3")
FAMILY_ALIASES = {"hermes": "hermes", "qwen": "hermes", "qwen2": "hermes", "qwen2.5": "hermes", "qwen3": "hermes",
                  "llama3": "llama3", "llama": "llama3", "llama3.1": "llama3", "llama3.2": "llama3",
                  "llama3.3": "llama3"}
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
LLAMA_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")
DEFAULT_TIMEOUT_S = 30.0

_executor: ThreadPoolExecutor | None = None


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


def family_name(family: str) -> str:
    key = str(family).lower().replace("-", "").replace("_", "")
    key = {"qwen25": "qwen2.5", "llama31": "llama3.1", "llama32": "llama3.2", "llama33": "llama3.3"}.get(key, key)
    if key not in FAMILY_ALIASES:
        raise ValueError(f"unknown tool-call family {family!r}; expected one of {', '.join(FAMILIES)}")
    return FAMILY_ALIASES[key]


def family_of_template(chat_template: str | None) -> str | None:
    """The tool-call family a chat template renders ("hermes", "llama3"), or None when it renders neither."""
    if not chat_template:
        return None
    if OPEN_TAG in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template or '"parameters": ' in chat_template:
        return "llama3"
    return None


# -- parsing ------------------------------------------------------------------------------------------


def _call_from_object(obj: Any, argument_keys: tuple[str, ...], start: int, end: int, raw: str):
    """A ToolCall from a decoded JSON value, or a ToolCallError saying what is wrong with it."""
    if not isinstance(obj, dict):
        return ToolCallError("a tool call must be a JSON object with \"name\" and \"arguments\"", None, start, end, raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError("the tool call has no \"name\" string", None, start, end, raw)
    key = next((k for k in argument_keys if k in obj), None)
    arguments = obj.get(key, {}) if key else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return ToolCallError(f"the arguments of '{name}' are not valid JSON", name, start, end, raw)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(f"the arguments of '{name}' must be a JSON object", name, start, end, raw)
    call_id = obj.get("id") if isinstance(obj.get("id"), str) else None
    return ToolCall(name=name, arguments=arguments, start=start, end=end, raw=raw, id=call_id)


def _hermes_block(text: str, open_at: int, close_at: int):
    inner_start = open_at + len(OPEN_TAG)
    end = close_at + len(CLOSE_TAG)
    raw = text[open_at:end]
    body = text[inner_start:close_at].strip()
    try:
        obj = json.loads(body)
    except ValueError as e:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', body)
        return ToolCallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})",
                             name.group(1) if name else None, open_at, end, raw)
    return _call_from_object(obj, ("arguments", "parameters"), open_at, end, raw)


def _json_object_end(text: str, start: int) -> int | None:
    """The index just past the JSON object starting at text[start] == "{", or None while it is open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _llama_start(text: str, start: int) -> int | None:
    """Where a Llama 3 call's JSON begins (after blanks and an optional <|python_tag|>), or None when the
    message is not (or cannot yet be seen to be) a call."""
    i = start
    while i < len(text) and text[i] in " \t\r\n;":
        i += 1
    if text.startswith(PYTHON_TAG, i):
        i += len(PYTHON_TAG)
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
    if i < len(text) and text[i] == "{":
        return i
    return None


def _llama_call(text: str, brace: int, end: int, call_start: int):
    raw = text[call_start:end]
    try:
        obj = json.loads(text[brace:end])
    except ValueError as e:
        return ToolCallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})", None, call_start, end,
                             raw)
    if isinstance(obj, dict) and "name" not in obj:
        return None  # a JSON answer, not a call
    return _call_from_object(obj, ("parameters", "arguments"), call_start, end, raw)


def parse_tool_calls(text: str, family: str = "hermes", tools=None) -> list:
    """Every tool call in a finished turn, in order: `ToolCall`s, and `ToolCallError`s for the unusable
    ones (an unterminated `<tool_call>` included). With `tools` (anything `make_tools` takes), each call
    is also checked against its tool's schema. A turn without calls gives []."""
    family = family_name(family)
    calls: list = []
    if family == "hermes":
        position = 0
        while True:
            open_at = text.find(OPEN_TAG, position)
            if open_at < 0:
                break
            close_at = text.find(CLOSE_TAG, open_at + len(OPEN_TAG))
            if close_at < 0:
                calls.append(ToolCallError("the tool call was cut off: <tool_call> has no closing </tool_call>",
                                           None, open_at, len(text), text[open_at:]))
                break
            calls.append(_hermes_block(text, open_at, close_at))
            position = close_at + len(CLOSE_TAG)
    else:
        position = 0
        while True:
            brace = _llama_start(text, position)
            if brace is None:
                break
            call_start = text.find(PYTHON_TAG, position, brace)
            call_start = brace if call_start < 0 else call_start
            end = _json_object_end(text, brace)
            if end is None:
                if text.startswith('{"name"', brace) or call_start != brace:
                    calls.append(ToolCallError("the tool call was cut off: its JSON object is not closed",
                                               None, call_start, len(text), text[call_start:]))
                break
            call = _llama_call(text, brace, end, call_start)
            if call is None:
                break
            calls.append(call)
            position = end
            for token in LLAMA_END_TOKENS:
                if text.startswith(token, position):
                    position += len(token)
    if tools is not None:
        table = make_tools(tools)
        calls = [validate_tool_call(c, table) if isinstance(c, ToolCall) else c for c in calls]
    return calls


def detect_tool_call(text: str, family: str = "hermes", start: int = 0, tools=None):
    """The first complete tool call at or after character `start` of a growing generation, or None.

    For the engine to call as text is generated: None until the closing `</tool_call>` (hermes) or the
    closing brace of the JSON object (llama3) has been generated, then the `ToolCall` (or the
    `ToolCallError` for an unusable one). `call.end` is where it ends: pass `start=call.end` to look for
    the next call of the same turn. A llama3 message that does not begin with `{` (or <|python_tag|>) is
    not a call: None, however long it grows."""
    family = family_name(family)
    if family == "hermes":
        open_at = text.find(OPEN_TAG, start)
        if open_at < 0:
            return None
        close_at = text.find(CLOSE_TAG, open_at + len(OPEN_TAG))
        if close_at < 0:
            return None
        call = _hermes_block(text, open_at, close_at)
    else:
        brace = _llama_start(text, start)
        if brace is None:
            return None
        end = _json_object_end(text, brace)
        if end is None:
            return None
        call_start = text.find(PYTHON_TAG, start, brace)
        call = _llama_call(text, brace, end, brace if call_start < 0 else call_start)
        if call is None:
            return None
    if tools is not None and isinstance(call, ToolCall):
        call = validate_tool_call(call, make_tools(tools))
    return call


# -- checking arguments against the schema ---------------------------------------------------------------

_JSON_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _json_type_of(value: Any) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _schema_error(value: Any, schema: dict, where: str) -> str | None:
    """Why `value` does not fit `schema` (the subset `get_json_schema` writes), or None when it does."""
    if not isinstance(schema, dict) or not schema:
        return None
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        if any(_schema_error(value, option, where) is None for option in schema["anyOf"]):
            return None
        return f"{where} does not match any of its allowed types (got {_json_type_of(value)} {_shown(value)})"
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else list(types)
        if not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in allowed):
            return f"{where} must be {' or '.join(allowed)}, got {_json_type_of(value)} {_shown(value)}"
    if "enum" in schema:
        if not any(value == choice and type(value) is type(choice) for choice in schema["enum"]):
            return f"{where} must be one of {json.dumps(schema['enum'])}, got {_shown(value)}"
    if isinstance(value, list):
        if "prefixItems" in schema:
            items = schema["prefixItems"]
            if len(value) != len(items):
                return f"{where} must have {len(items)} items, got {len(value)}"
            for i, (item, item_schema) in enumerate(zip(value, items)):
                if (error := _schema_error(item, item_schema, f"{where}[{i}]")) is not None:
                    return error
        elif "items" in schema:
            for i, item in enumerate(value):
                if (error := _schema_error(item, schema["items"], f"{where}[{i}]")) is not None:
                    return error
    if isinstance(value, dict):
        for key, item in value.items():
            sub = (schema.get("properties") or {}).get(key, schema.get("additionalProperties"))
            if isinstance(sub, dict) and (error := _schema_error(item, sub, f"{where}[{key!r}]")) is not None:
                return error
    return None


def validate_tool_call(call: ToolCall, tools) -> ToolCall | ToolCallError:
    """The call itself when it names a tool and its arguments fit the tool's schema, else a ToolCallError:
    unknown tool, missing required argument, unexpected argument, value of the wrong type."""
    table = make_tools(tools)
    err = functools.partial(ToolCallError, name=call.name, start=call.start, end=call.end, raw=call.raw)
    tool = table.get(call.name)
    if tool is None:
        known = ", ".join(sorted(table)) or "none"
        return err(f"unknown tool '{call.name}'; the tools are: {known}")
    parameters = tool.parameters
    properties = parameters.get("properties") or {}
    missing = [name for name in parameters.get("required", []) if name not in call.arguments]
    if missing:
        listed = ", ".join(f"'{m}'" for m in missing)
        return err(f"tool '{call.name}' is missing required argument{'s' if len(missing) > 1 else ''} {listed}")
    unexpected = [name for name in call.arguments if name not in properties]
    if unexpected and parameters.get("additionalProperties", False) is not True:
        accepted = ", ".join(properties) or "none"
        return err(f"tool '{call.name}' has no argument '{unexpected[0]}' (its arguments: {accepted})")
    for name, value in call.arguments.items():
        if (error := _schema_error(value, properties.get(name, {}), f"argument '{name}'")) is not None:
            return err(f"tool '{call.name}': {error}")
    return call


# -- executing -------------------------------------------------------------------------------------------


def _tool_executor() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="cohort-tool")
    return _executor


def result_text(result: Any) -> str:
    """A tool's return value as the model sees it: TRL's `str(result)` (a str stays as it is)."""
    return result if isinstance(result, str) else str(result)


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


# -- chat messages and text --------------------------------------------------------------------------------


def tool_result_messages(call, result) -> list[dict]:
    """The tool turn for a call's result, for `apply_chat_template`: [{"role": "tool", "name", "content"}]
    (TRL's form; the template renders it, e.g. as Qwen's <tool_response> block). `result` is the text,
    or what `execute_tool_call` returned; a ToolCallError may stand for both call and result."""
    if isinstance(result, ToolResult):
        result = result.text
    if result is None and isinstance(call, ToolCallError):
        result = call.result_text
    name = call.name if getattr(call, "name", None) else "unknown"
    message = {"role": "tool", "name": name, "content": result_text(result)}
    if getattr(call, "id", None):
        message["tool_call_id"] = call.id
    return [message]


def assistant_message(calls, content: str = "") -> dict:
    """The assistant turn that made `calls`, in the transformers chat format (arguments as dicts), so that
    `apply_chat_template` renders it in the model's own format. ToolCallErrors are left out."""
    tool_calls = []
    for call in calls:
        if isinstance(call, ToolCall):
            entry = {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            if call.id:
                entry["id"] = call.id
            tool_calls.append(entry)
    message: dict = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def format_tool_calls(calls, family: str = "hermes") -> str:
    """The text a model of `family` generates for `calls` (ToolCalls or {"name", "arguments"} dicts)."""
    family = family_name(family)
    pairs = []
    for call in calls:
        if isinstance(call, ToolCall):
            pairs.append((call.name, call.arguments))
        else:
            function = call.get("function", call)
            pairs.append((function["name"], function.get("arguments", {})))
    if family == "hermes":
        return "\n".join(f'{OPEN_TAG}\n{json.dumps({"name": n, "arguments": a}, ensure_ascii=False)}\n{CLOSE_TAG}'
                         for n, a in pairs)
    if len(pairs) > 1:
        raise ValueError("Llama 3 JSON tool calling makes one call per message")
    return "".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in pairs)


@dataclass
class ParsedTurn:
    """A finished assistant turn: its text outside the calls, and the calls."""

    content: str
    calls: list = field(default_factory=list)


def split_turn(text: str, family: str = "hermes", tools=None) -> ParsedTurn:
    """The turn's content (its text with the calls cut out, stripped) and its calls (`parse_tool_calls`)."""
    calls = parse_tool_calls(text, family, tools)
    pieces, position = [], 0
    for call in sorted(calls, key=lambda c: c.start):
        pieces.append(text[position:call.start])
        position = max(position, call.end)
    pieces.append(text[position:])
    return ParsedTurn(content="".join(pieces).strip(), calls=calls)
