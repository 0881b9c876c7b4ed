"""Tool schemas from typed, documented functions (transformers' get_json_schema), their errors as one-line
CohortErrors, and the tools of an environment object (TRL's environment_factory contract)."""

from __future__ import annotations

import enum
from typing import Literal, Optional, Union

import pytest

from cohort_grpo.errors import CohortError
from cohort_grpo.tools import Tool, environment_tools, make_tool, make_tools, tool_schema


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.

    Returns:
        The product a * b.
    """
    return a * b


async def convert(amount: float, unit: Literal["km", "mi"] = "km", note: str | None = None) -> str:
    """Convert a distance.

    Args:
        amount: The distance.
        unit: The unit it is in.
        note: Anything to add.
    """
    return f"{amount} {unit}"


MULTIPLY_SCHEMA = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "The first factor."},
                "b": {"type": "integer", "description": "The second factor."},
            },
            "required": ["a", "b"],
        },
        "return": {"type": "integer", "description": "The product a * b."},
    },
}


def test_schema_of_a_typed_function_with_a_google_docstring():
    assert tool_schema(multiply) == MULTIPLY_SCHEMA


def test_schema_of_an_async_function_with_optional_arguments():
    assert tool_schema(convert)["function"] == {
        "name": "convert",
        "description": "Convert a distance.",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "description": "The distance."},
                "unit": {"type": "string", "enum": ["km", "mi"], "description": "The unit it is in."},
                "note": {"type": "string", "nullable": True, "description": "Anything to add."},
            },
            "required": ["amount"],
        },
        "return": {"type": "string"},
    }
    tool = make_tool(convert)
    assert tool.is_async and tool.name == "convert" and not make_tool(multiply).is_async


def test_a_missing_type_hint_is_a_one_line_error_naming_function_and_argument():
    def add(a: int, b) -> int:
        """Add.

        Args:
            a: One.
            b: Two.
        """
        return a + b

    with pytest.raises(CohortError) as info:
        tool_schema(add)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("tool test_a_missing_type_hint_is_a_one_line_error_naming_function_and_argument"
                              ".<locals>.add: argument 'b' has no type hint")


def test_a_missing_args_entry_and_a_missing_docstring_are_named():
    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: One.
        """
        return a + b

    def subtract(a: int, b: int) -> int:
        return a - b

    with pytest.raises(CohortError, match=r"add: the docstring's `Args:` section has no entry for 'b'"):
        tool_schema(add)
    with pytest.raises(CohortError, match=r"subtract: has no docstring; write a Google-style one"):
        tool_schema(subtract)


class Point:
    pass


class Colour(enum.Enum):
    RED = "red"


def test_a_type_that_json_schema_cannot_express_is_named():
    def move(p: Point) -> None:
        """Move.

        Args:
            p: Where to.
        """

    with pytest.raises(CohortError, match=r"move: a type hint cannot be written as JSON schema") as info:
        tool_schema(move)
    assert "\n" not in str(info.value)

    def jump(to: "Nowhere") -> None:  # noqa: F821 - a name that does not exist
        """Jump.

        Args:
            to: Where to.
        """

    with pytest.raises(CohortError, match=r"jump: a type hint cannot be resolved \(name 'Nowhere' is not defined\)"):
        tool_schema(jump)


def test_make_tools_accepts_functions_dicts_and_hand_written_schemas():
    def opaque(**kwargs):
        return "ok"

    hand = {"type": "function", "function": {"name": "opaque", "description": "Anything.",
                                             "parameters": {"type": "object", "properties": {}}}}
    tools = make_tools([multiply, convert, (opaque, hand)])
    assert list(tools) == ["multiply", "convert", "opaque"]
    assert all(isinstance(t, Tool) for t in tools.values())
    assert tools["opaque"].schema is hand
    assert make_tools({"multiply": multiply})["multiply"].schema == MULTIPLY_SCHEMA
    with pytest.raises(CohortError, match="two tools are named 'multiply'"):
        make_tools([multiply, multiply])


class Counter:
    """An environment: TRL calls reset(**row) before each rollout, the model calls its tools."""

    def __init__(self):
        self.total = 0
        self.target = 0

    def reset(self, target: int = 10, **row) -> str | None:
        self.total, self.target = 0, target
        return f"Reach {target}."

    def get_reward(self) -> float:
        return float(self.total == self.target)

    def add(self, n: int) -> str:
        """Add to the counter.

        Args:
            n: How much to add.
        """
        self.total += n
        return str(self.total)

    async def peek(self) -> int:
        """The counter's value."""
        return self.total

    def _helper(self) -> None:
        pass

    @property
    def broken(self):
        raise AssertionError("properties must not be evaluated")

    @staticmethod
    def not_a_method(x: int) -> int:
        return x


def test_environment_tools_are_its_public_methods_but_reset_and_get_reward():
    env = Counter()
    tools = environment_tools(env)
    assert [name for name, _, _ in tools] == ["add", "peek"]
    name, add, schema = tools[0]
    assert schema["function"]["parameters"]["properties"] == {"n": {"type": "integer", "description": "How much to add."}}
    assert add(3) == "3" and env.total == 3  # bound to the instance
    assert make_tools(tools)["peek"].is_async
    assert env.reset(target=5) == "Reach 5." and env.total == 0


def test_an_environment_without_reset_or_with_an_undocumented_tool_is_refused():
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: A number.
            """
            return x

    class Undocumented(Counter):
        def jump(self, height: int) -> None:
            pass

    with pytest.raises(CohortError, match="environment NoReset: has no callable reset"):
        environment_tools(NoReset())
    with pytest.raises(CohortError, match="jump: has no docstring"):
        environment_tools(Undocumented())


def test_unexpressible_hints_are_found_whatever_transformers_does():
    """cohort judges the hints itself: transformers 5.17 writes {"type": "object"} for a custom class
    instead of refusing it, so a tool with such an argument would reach the model with no schema."""
    from cohort_grpo.tools.schema import unexpressible_hint

    def ok(a: int, b: Optional[str], c: Literal["x", "y"], d: Colour, e: dict[str, list[float]],
           f: tuple[int, ...], g: Union[int, str], h: bool | None) -> Point:
        return Point()

    def custom(a: int, b: list[Point]) -> None:
        return None

    def nested(a: dict[str, Optional[Point]]) -> None:
        return None

    assert unexpressible_hint(ok) is None
    assert unexpressible_hint(custom) is Point
    assert unexpressible_hint(nested) is Point
