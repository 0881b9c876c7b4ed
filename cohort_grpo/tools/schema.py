"""JSON schemas of tools, as chat templates expect them (`apply_chat_template(..., tools=[schema, ...])`).

A tool is a typed Python function (sync or async) with a Google-style docstring, as in TRL's
`GRPOTrainer(tools=[...])`:

    def multiply(a: int, b: int) -> int:
        \"\"\"Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        \"\"\"
        return a * b

    tool_schema(multiply)  # {"type": "function", "function": {"name": "multiply", "description": ..., ...}}

The schema comes from transformers' own `get_json_schema`, so it is exactly what the chat template would
render from the function itself; its errors become one-line `CohortError`s naming the function and what
is missing. `environment_tools(env)` lists the tools of an environment object (TRL's
`environment_factory` contract: `reset(**row)` returns a string to append to the prompt or None,
`get_reward()` may score the rollout, every other public method is a tool).
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from cohort_grpo.errors import CohortError

ENVIRONMENT_METHODS = ("reset", "get_reward")  # an environment's methods that are not tools


@dataclass(frozen=True)
class Tool:
    """A callable tool with its name and JSON schema; `is_async` says whether it must be awaited."""

    name: str
    function: Callable[..., Any]
    schema: dict
    is_async: bool

    @property
    def parameters(self) -> dict:
        return self.schema.get("function", {}).get("parameters", {}) or {}


def _name_of(function) -> str:
    return getattr(function, "__qualname__", None) or getattr(function, "__name__", None) or repr(function)


def tool_schema(function: Callable[..., Any]) -> dict:
    """The JSON schema of a typed function with a Google-style docstring (transformers' `get_json_schema`).

    Raises CohortError (one line, naming the function) when a type hint or a docstring entry is missing
    or cannot be expressed in JSON schema."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    name = _name_of(function)
    if not callable(function):
        raise CohortError(f"tool {function!r} is not callable; pass a function or a method")
    if not hasattr(function, "__name__"):
        raise CohortError(f"tool {name}: has no __name__ (a functools.partial or a callable object?); "
                          "wrap it in a def with its own name, type hints and docstring")
    try:
        unexpressible = unexpressible_hint(function)
        if unexpressible is not None:  # some transformers versions write {"type": "object"} for a custom class
            raise TypeHintParsingException(f"Couldn't convert the type hint {unexpressible!r} to a JSON schema")
        return get_json_schema(function)
    except TypeHintParsingException as e:
        message = " ".join(str(e).split())
        missing = re.match(r"Argument (\w+) is missing a type hint", message)
        if missing:
            arg = missing.group(1)
            raise CohortError(f"tool {name}: argument '{arg}' has no type hint; annotate it (for example "
                              f"`{arg}: int`), since the tool's JSON schema is made from the type hints") from None
        raise CohortError(f"tool {name}: a type hint cannot be written as JSON schema ({message[:200]}); use str, "
                          "int, float, bool, Literal, Enum, or list/dict/tuple/Optional/unions of them") from None
    except DocstringParsingException as e:
        message = " ".join(str(e).split())
        if "has no docstring" in message:
            raise CohortError(f"tool {name}: has no docstring; write a Google-style one: a description, then an "
                              "`Args:` section with a line `name: what it is` for each argument") from None
        missing = re.search(r"no description for the argument '(\w+)'", message)
        if missing:
            arg = missing.group(1)
            raise CohortError(f"tool {name}: the docstring's `Args:` section has no entry for '{arg}'; add a line "
                              f"`{arg}: what it is` under `Args:`") from None
        raise CohortError(f"tool {name}: cannot read its docstring ({message[:200]})") from None
    except NameError as e:  # a string annotation naming something that is not defined
        raise CohortError(f"tool {name}: a type hint cannot be resolved ({e})") from None


JSON_SCALARS = (str, int, float, bool, type(None), Any)
JSON_CONTAINERS = (list, dict, tuple, typing.Union, types.UnionType, typing.Literal)


def unexpressible_hint(function: Callable[..., Any]):
    """The first argument type hint of `function` that JSON schema cannot express, or None: what is
    left is str, int, float, bool, None, Any, Enum classes, Literal, and list/dict/tuple/unions of them.
    Raises NameError for a string hint naming nothing."""
    hints = typing.get_type_hints(function)
    hints.pop("return", None)

    def first_bad(hint):
        if hint in JSON_SCALARS or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
            return None
        origin = typing.get_origin(hint)
        if origin is typing.Literal:
            return None
        if origin in JSON_CONTAINERS or hint in (list, dict, tuple):
            return next((bad for arg in typing.get_args(hint) if arg is not Ellipsis
                         for bad in [first_bad(arg)] if bad is not None), None)
        return hint

    return next((bad for hint in hints.values() for bad in [first_bad(hint)] if bad is not None), None)


def is_async_callable(function: Callable[..., Any]) -> bool:
    """Whether calling `function` returns a coroutine (an `async def` function or bound method)."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None))


def make_tool(tool) -> Tool:
    """A `Tool` from a function, a `Tool`, a (name, function, schema) triple (as `environment_tools`
    gives) or a (function, schema) pair (a hand-written schema)."""
    if isinstance(tool, Tool):
        return tool
    if isinstance(tool, tuple):
        if len(tool) == 3:
            name, function, schema = tool
        elif len(tool) == 2:
            function, schema = tool
            name = schema.get("function", {}).get("name") or getattr(function, "__name__", None)
        else:
            raise CohortError(f"tool {tool!r}: expected a function, (function, schema) or (name, function, schema)")
        if not callable(function) or not isinstance(schema, dict) or not name:
            raise CohortError(f"tool {tool!r}: expected a callable, a schema dict and a name")
        return Tool(name=str(name), function=function, schema=schema, is_async=is_async_callable(function))
    schema = tool_schema(tool)
    return Tool(name=schema["function"]["name"], function=tool, schema=schema, is_async=is_async_callable(tool))


def make_tools(tools) -> dict[str, Tool]:
    """{name: Tool} from a list of tools (anything `make_tool` takes), a {name: function} dict or an
    existing {name: Tool} dict. Two tools with one name are an error."""
    if isinstance(tools, dict):
        if all(isinstance(t, Tool) for t in tools.values()):
            return dict(tools)
        items: Iterable = [(name, fn, tool_schema(fn)) if not isinstance(fn, Tool) else fn
                           for name, fn in tools.items()]
    else:
        items = tools or []
    out: dict[str, Tool] = {}
    for item in items:
        tool = make_tool(item)
        if tool.name in out:
            raise CohortError(f"two tools are named '{tool.name}'; tool names must be unique")
        out[tool.name] = tool
    return out


def environment_tools(env) -> list[tuple[str, Callable[..., Any], dict]]:
    """The tools of an environment instance, as (name, bound method, schema), sorted by name.

    TRL's `environment_factory` contract: the instance has a callable `reset(**row)` (returns a string to
    append to the last user message, or None) and may have `get_reward()`; every other public method
    (bound method whose name does not start with "_") is a tool, needing type hints and a Google-style
    docstring like any tool. Properties are not evaluated."""
    if not callable(getattr(env, "reset", None)):
        raise CohortError(f"environment {type(env).__name__}: has no callable reset(**row); an environment must "
                          "define reset, returning the text to append to the prompt or None")
    tools = []
    for name in sorted(dir(env)):
        if name.startswith("_") or name in ENVIRONMENT_METHODS:
            continue
        if isinstance(inspect.getattr_static(env, name, None), property):
            continue
        member = getattr(env, name, None)
        if not inspect.ismethod(member):
            continue
        tools.append((name, member, tool_schema(member)))
    return tools
