"""Per-row records: dataclasses whose fields hold one value per row of a rollout, operated on field by field.

Each field declares how its value is laid out (`record_field`), and `RowRecord` does every operation from that:
rows picked by index or range (`select`), records joined (`concatenate`), completions cut to a width (`cut`), and
the plain values a checkpoint or a message between ranks keeps (`state` / `from_state`). A new field is then one
declaration, and every operation carries it (tests/test_records.py builds its values from the declarations).

How a field's value is laid out; its first axis is always the row:

- ROWS: one value per row, nothing else to align (lists; [B] and [B, F] tensors).
- COMPLETION: [B, T, ...] by completion token. Joined records are right-padded to the widest with the field's
  `pad` (PAD_TOKEN: the pad token id `concatenate` is given); `cut` keeps the first columns. A 1-D value ([B]) is
  joined as ROWS.
- POSITION: [B, S, ...] by position of [prompt | completion]: right-padded with `pad` to the widest, never cut.
- WHOLE: one value for the whole record (its metrics): a selection keeps it, `concatenate` merges the parts'
  with `merge` (default: the first part's).

A field that some of the joined parts lack (None) is None in the result, unless it says what a part without it
stands for (`absent`). A field holding a record of its own (`record=`) is operated on in turn, and its state is
flattened into this one's.
"""

from __future__ import annotations

from dataclasses import field, fields, replace
from typing import Any, Callable

import torch

ROWS, COMPLETION, POSITION, WHOLE = "rows", "completion", "position", "whole"
PAD_TOKEN = "pad token"  # a COMPLETION field padded with the pad token id given to `concatenate`


def record_field(layout: str = ROWS, *, pad: Any = 0, absent: Callable[[Any], Any] | None = None,
                 merge: Callable[[list], Any] | None = None, state: bool = True, record: type | None = None,
                 stored: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None, **options) -> Any:
    """A `dataclasses.field` of a `RowRecord` (`options`: default, default_factory). `absent(part)`: what a part
    whose value is None stands for when joined with parts that have one; `state`: kept by `RowRecord.state`;
    `record`: the `RowRecord` class the field holds; `stored`: (to, back), the field's value as the plain values a
    checkpoint loads with `weights_only=True` (tensors, numbers, strings, containers) and back again."""
    if layout not in (ROWS, COMPLETION, POSITION, WHOLE):
        raise ValueError(f"layout={layout!r}: one of {ROWS!r}, {COMPLETION!r}, {POSITION!r}, {WHOLE!r}")
    metadata = {"layout": layout, "pad": pad, "absent": absent, "merge": merge, "state": state, "record": record,
                "stored": stored}
    return field(metadata=metadata, **options)


def layout_of(declared) -> str:
    """The layout a dataclass field declares (a field not made by `record_field` holds one value per row)."""
    return declared.metadata.get("layout", ROWS)


def joined(values: list[torch.Tensor], layout: str, pad, width: int) -> torch.Tensor:
    """`values` one after the other along the rows; by COMPLETION or POSITION, right-padded with `pad` to
    `width` columns (POSITION: to the widest)."""
    first = values[0]
    if layout == ROWS or first.dim() < 2:
        return torch.cat(values)
    if layout == POSITION:
        width = max(v.shape[1] for v in values)
    out = first.new_full((sum(v.shape[0] for v in values), width, *first.shape[2:]), pad)
    start = 0
    for value in values:
        out[start: start + value.shape[0], : value.shape[1]] = value
        start += value.shape[0]
    return out


class RowRecord:
    """Operations over the fields of a dataclass of per-row values (see the module docstring)."""

    def select(self, index: slice | list[int]):
        """Rows `index` of every per-row field, in that order (a slice keeps the tensors as views)."""
        positions = index if isinstance(index, slice) else torch.tensor(list(index), dtype=torch.long)
        changes = {}
        for declared in fields(self):
            value = getattr(self, declared.name)
            if value is None or layout_of(declared) == WHOLE:
                continue
            if isinstance(value, RowRecord):
                changes[declared.name] = value.select(index)
            elif isinstance(value, torch.Tensor):
                changes[declared.name] = value[positions]
            else:
                changes[declared.name] = value[index] if isinstance(index, slice) else [value[i] for i in index]
        return replace(self, **changes)

    @classmethod
    def concatenate(cls, parts: list, pad_id: int = 0, width: int = 0):
        """One record of `parts`' rows, in order; COMPLETION fields right-padded to the widest part (at least
        `width` columns), PAD_TOKEN with `pad_id`. A single part with no `width` asked is returned as it is."""
        if len(parts) == 1 and width == 0:
            return parts[0]
        declared_fields = fields(cls)
        width = max([width, *(value.shape[1] for part in parts for declared in declared_fields
                               if layout_of(declared) == COMPLETION
                               and isinstance(value := getattr(part, declared.name), torch.Tensor) and value.dim() > 1)])
        values = {}
        for declared in declared_fields:
            meta, layout = declared.metadata, layout_of(declared)
            column = [getattr(part, declared.name) for part in parts]
            if layout == WHOLE:
                values[declared.name] = (meta.get("merge") or (lambda merged: merged[0]))(column)
                continue
            if any(value is None for value in column):
                absent = meta.get("absent")
                if absent is None or all(value is None for value in column):
                    values[declared.name] = None
                    continue
                column = [absent(part) if value is None else value for part, value in zip(parts, column)]
            first = column[0]
            if isinstance(first, RowRecord):
                values[declared.name] = type(first).concatenate(column, pad_id)
            elif isinstance(first, torch.Tensor):
                pad = meta.get("pad", 0)
                values[declared.name] = joined(column, layout, pad_id if pad == PAD_TOKEN else pad, width)
            else:
                values[declared.name] = [item for value in column for item in value]
        return cls(**values)

    def cut(self, width: int):
        """Every COMPLETION field cut to its first `width` columns."""
        changes = {declared.name: value[:, :width] for declared in fields(self)
                   if layout_of(declared) == COMPLETION
                   and isinstance(value := getattr(self, declared.name), torch.Tensor) and value.dim() > 1}
        return replace(self, **changes)

    def state(self) -> dict:
        """The fields kept in a checkpoint or a message between ranks, as plain values by name (a field holding a
        record: that record's, flattened in)."""
        out = {}
        for declared in fields(self):
            if not declared.metadata.get("state", True):
                continue
            value = getattr(self, declared.name)
            stored = declared.metadata.get("stored")
            if declared.metadata.get("record") is not None:
                out.update(value.state())
            else:
                out[declared.name] = stored[0](value) if stored and value is not None else value
        return out

    @classmethod
    def from_state(cls, item: dict):
        """Inverse of `state`; a field the state lacks (written before the field existed) takes its default."""
        values = {}
        for declared in fields(cls):
            if not declared.metadata.get("state", True):
                continue
            record, stored = declared.metadata.get("record"), declared.metadata.get("stored")
            if record is not None:
                values[declared.name] = record.from_state(item)
            elif declared.name in item:
                value = item[declared.name]
                values[declared.name] = stored[1](value) if stored and value is not None else value
        return cls(**values)
