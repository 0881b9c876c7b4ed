"""Tool calls in a model family's text format: parse a finished turn, detect a call while generating,
write calls as the family's text.

Text in, structured out; nothing here knows about tokens. Two families:

* "hermes" (Qwen2.5, Qwen3, Hermes, and most templates that use these tags): one or more
  `<tool_call>\\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\\n</tool_call>` blocks in the turn,
  possibly after some text.
* "llama3" (Llama 3.1, 3.2, 3.3 JSON tool calling): the whole message is
  `{"name": "multiply", "parameters": {"a": 3, "b": 4}}`, optionally after `<|python_tag|>`.

A call that cannot be used is a `ToolCallError` (`call_records`) in the list, in place of the call. One
round, with the other steps' functions (all exported by `cohort_grpo.tools`):

    calls = parse_tool_calls(text, "hermes", tools)             # [ToolCall | ToolCallError, ...]
    call = detect_tool_call(text_so_far, "hermes")              # None until a call is complete
    text, failed, seconds = await execute_tool_call(call, tools, timeout_s=10)   # call_execution
    messages += [assistant_message(calls), *tool_result_messages(call, text)]    # call_messages
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from cohort_grpo.tools.call_records import ToolCall, ToolCallError
from cohort_grpo.tools.call_validation import validate_tool_call
from cohort_grpo.tools.schema import make_tools

FAMILIES = ("hermes", "llama3")
FAMILY_ALIASES = {"hermes": "hermes", "qwen": "hermes", "qwen2": "hermes", "qwen2.5": "hermes", "qwen3": "hermes",
                  "llama3": "llama3", "llama": "llama3", "llama3.1": "llama3", "llama3.2": "llama3",
                  "llama3.3": "llama3"}
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
LLAMA_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")


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


# -- writing calls and splitting a turn -----------------------------------------------------------------


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
