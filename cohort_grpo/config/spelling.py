"""An error message's option names as the Python API spells them.

Messages are written once, in the command line's words (`pass --resume`, `give --max_staleness 1`), since
the same check serves `cohort-grpo train` and `GRPOConfig(...)`. Shown to a Python caller, `python_spelling`
turns each `--name [value]` span whose name is a `GRPOConfig` option into the keyword a script writes
(`resume=True`, `max_staleness=1`); a `--name` that is no option (`--nproc_per_node`, `--config`), a flag
quoted as an argument (`'--lr'`) and all other text stay as they are. A value is taken only where it fits
the option (a number for a number, one of its fixed values, a placeholder such as FILE), so prose after a
name (`--model it was trained from`) is never mistaken for one.

The options come from `cohort_grpo.config.grpo_config`, which hands them over with `learn_options` once `GRPOConfig`
exists; it hands `python_spelling` to cohort_grpo.errors, which shows every message.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Mapping

from cohort_grpo.errors import spell_for_python

# name → (type annotation, the fixed values the option takes, empty when any value goes)
OptionTable = Mapping[str, tuple[object, tuple[str, ...]]]

_table_source: list[Callable[[], OptionTable]] = []
_table: dict[str, tuple[object, tuple[str, ...]]] = {}

# `--name`, not inside a quoted argument or a longer dash run; then, maybe, ` value` or `=value`.
OPTION_SPAN = re.compile(r"(?<![\w'\"-])--(?P<name>[a-z][a-z0-9_]*)(?![\w-])"
                         r"(?:(?P<sep>[ =])(?P<value>(?!--)[^\s;()]+))?")
NEXT_OPTION = re.compile(r" --(?P<name>[a-z][a-z0-9_]*)")
NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")  # FILE, NAME, N: the reader fills it in
STAGE = re.compile(r"(?P<task>[\w-]+):(?P<steps>\d+)")


def learn_options(source: Callable[[], OptionTable]) -> None:
    """Where the option table comes from (called by cohort_grpo.config.grpo_config); read at the first message shown."""
    _table_source[:] = [source]
    _table.clear()


def options() -> Mapping[str, tuple[object, tuple[str, ...]]]:
    if not _table and _table_source:
        _table.update(_table_source[0]())
    return _table


def python_spelling(message: str) -> str:
    """`message` with every `--option [value]` of a known option written as a Python keyword."""
    known = options()
    if "--" not in message or not known:
        return message

    def rewrite(match: re.Match) -> str:
        name = match.group("name")
        if name not in known:
            return match.group(0)
        hint, choices = known[name]
        raw = match.group("value")
        value, trail = (raw[:len(raw.rstrip(",.:"))], raw[len(raw.rstrip(",.:")):]) if raw else (None, "")
        keyword = keyword_of(name, hint, choices, value) if value else None
        if keyword is not None:
            # `--a 0 --b 0` lists two options; two keywords read as arguments do, with a comma.
            follows = NEXT_OPTION.match(message, match.end())
            return keyword + trail + ("," if not trail and follows and follows.group("name") in known else "")
        rest = match.group("sep") + raw if raw else ""
        if arms(hint) == {bool}:
            # A bare flag turns the option on; "leave --x off" already reads as Python's words do.
            following = (raw or message[match.end():].lstrip()).split(" ", 1)[0].rstrip(",.;)")
            return name + rest if following in ("off", "on") or match.group("sep") == "=" else f"{name}=True{rest}"
        return name + rest

    return OPTION_SPAN.sub(rewrite, message)


def arms(hint) -> set:
    """The types an annotation allows, None left out: `int | str | None` → {int, str}."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return {typing.get_origin(arm) or arm for arm in (typing.get_args(hint) if union else (hint,))} - {type(None)}


def keyword_of(name: str, hint, choices: tuple[str, ...], value: str) -> str | None:
    """`name=<value as Python writes it>`, or None when `value` is no value of this option (mere prose)."""
    kinds = arms(hint)
    word = value.lower()
    if word in ("true", "false") and (bool in kinds or word in choices):
        return f"{name}={word == 'true'}"
    if word in ("none", "null") and type(None) in typing.get_args(hint) and word not in choices:
        return f"{name}=None"
    if PLACEHOLDER.fullmatch(value) and kinds != {bool}:
        return f"{name}={value}"
    if kinds & {int, float} and NUMBER.fullmatch(value):
        return f"{name}={value}"
    if list in kinds:
        (item,) = typing.get_args(next(arm for arm in (typing.get_args(hint) or (hint,))
                                       if (typing.get_origin(arm) or arm) is list)) or (str,)
        if item is dict:  # a curriculum's TASK:STEPS stages
            stages = [STAGE.fullmatch(part) for part in value.split(",")]
            if not all(stages):
                return None
            return f"{name}={[{'task': s['task'], 'steps': int(s['steps'])} for s in stages]!r}"
        items = value.split(",")
        if any(":" in part or "/" in part for part in items) or all(part in choices for part in items):
            return f"{name}={items!r}"
        return None
    if str in kinds and (value in choices or any(mark in value for mark in ":/.")):
        return f"{name}={value!r}"
    return None


spell_for_python(python_spelling)
