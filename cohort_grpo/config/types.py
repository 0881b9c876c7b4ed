"""The type each `GRPOConfig` option's value must have, checked where the value is given.

A value of the wrong type would otherwise surface far from where it was written, as Python's own
message about an operator (`'<' not supported between instances of 'str' and 'int'`). A whole number
is a float too; True and False are no numbers here; items of a list are the consumer's to check.
"""

from __future__ import annotations

import numbers
import types
import typing
from collections.abc import Mapping


def fits(value, hint) -> bool:
    """Whether `value` is of the type annotation `hint` (str, int, float, bool, list, dict, None, unions)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(fits(value, arm) for arm in typing.get_args(hint))
    base = typing.get_origin(hint) or hint
    if base is type(None):
        return value is None
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if base is str:
        return isinstance(value, str)
    if base is list:
        return isinstance(value, (list, tuple))
    if base is dict:
        return isinstance(value, Mapping)
    return True


def type_name(hint) -> str:
    """`int`, `float or None`, `list`: the annotation as a sentence says it."""
    arms = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    names = ["None" if arm is type(None) else getattr(typing.get_origin(arm) or arm, "__name__", str(arm))
             for arm in arms]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def type_problem(name: str, value, hint) -> str | None:
    """The one-line complaint about option `name`'s `value`, or None when it has the type `hint` names."""
    if fits(value, hint):
        return None
    return f"GRPOConfig({name}={value!r}): {name} takes {type_name(hint)}, not {type(value).__name__}"
