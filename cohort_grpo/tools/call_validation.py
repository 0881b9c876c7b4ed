"""A tool call checked against its tool's JSON schema (`validate_tool_call`): an unknown tool, a missing
required argument, an unexpected argument or a value of the wrong type gives a `ToolCallError` whose
message the model sees. The schema is the subset transformers' `get_json_schema` writes (`schema`).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from cohort_grpo.tools.call_records import ToolCall, ToolCallError
from cohort_grpo.tools.schema import make_tools

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
