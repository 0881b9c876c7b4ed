"""`Rollout` and `Batch` as per-row records (cohort_grpo/rollout/records.py): every field survives a selection, a
concatenation and a checkpoint state's round trip.

The records are built from their own field declarations, one distinct value per field, so a field added later is
covered by these tests without a change here; each result is checked field by field against an independent
computation (indexing, padding and joining the values by hand)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cohort_grpo.rollout.batch import Batch, select_groups
from cohort_grpo.rollout.records import COMPLETION, PAD_TOKEN, POSITION, ROWS, WHOLE, RowRecord, layout_of
from cohort_grpo.rollout.sampler import Rollout

PAD_ID = 7
RECORDS = [Rollout, Batch]


def made(cls, rows: int, width: int, tag: str, seed: int):
    """An instance of `cls` with every field set from its declaration: `rows` rows, COMPLETION fields `width`
    columns, POSITION fields `width + 2`, each value distinct from every other's."""
    generator = torch.Generator().manual_seed(seed)
    values = {}
    for declared in dataclasses.fields(cls):
        layout, nested = layout_of(declared), declared.metadata.get("record")
        if nested is not None:
            values[declared.name] = made(nested, rows, width, tag, seed + 1)
        elif layout == WHOLE:
            values[declared.name] = {f"{declared.name}/value": float(seed)}
        elif "Tensor" not in str(declared.type):  # a list, one value per row
            values[declared.name] = [f"{tag}-{declared.name}-{i}" for i in range(rows)]
        elif layout == ROWS:
            values[declared.name] = torch.randn(rows, 3, generator=generator)
        elif layout == COMPLETION:
            values[declared.name] = torch.randint(10, 100, (rows, width), generator=generator)
        else:
            values[declared.name] = torch.randint(10, 100, (rows, width + 2, 2), generator=generator).short()
    return cls(**values)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, RowRecord):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def padded(value: torch.Tensor, width: int, pad) -> torch.Tensor:
    out = torch.full((value.shape[0], width, *value.shape[2:]), pad, dtype=value.dtype)
    out[:, : value.shape[1]] = value
    return out


@pytest.mark.parametrize("cls", RECORDS)
def test_every_field_declares_its_layout(cls):
    for declared in dataclasses.fields(cls):
        assert declared.metadata.get("layout") in (ROWS, COMPLETION, POSITION, WHOLE), declared.name


@pytest.mark.parametrize("cls", RECORDS)
def test_a_selection_takes_the_rows_of_every_field(cls):
    record, index = made(cls, 5, 4, "a", 0), [3, 0, 3, 4]

    def expected(declared, value):
        if layout_of(declared) == WHOLE:
            return value
        if isinstance(value, RowRecord):
            return type(value)(**{f.name: expected(f, getattr(value, f.name)) for f in dataclasses.fields(value)})
        if isinstance(value, torch.Tensor):
            return torch.stack([value[i] for i in index])
        return [value[i] for i in index]

    chosen = record.select(index)
    for declared in dataclasses.fields(cls):
        assert same(getattr(chosen, declared.name), expected(declared, getattr(record, declared.name))), declared.name
    ranged = record.select(slice(1, 4))
    assert same(ranged, record.select([1, 2, 3]))


def test_select_groups_takes_each_groups_rows_in_order():
    batch = made(Batch, 6, 3, "a", 0)
    assert same(select_groups(batch, [2, 0], 2), batch.select([4, 5, 0, 1]))


@pytest.mark.parametrize("cls", RECORDS)
def test_a_concatenation_joins_every_field_padded_to_the_widest_part(cls):
    first, second = made(cls, 2, 3, "a", 0), made(cls, 3, 5, "b", 10)
    joined = cls.concatenate([first, second], pad_id=PAD_ID)

    def check(record_cls, whole, a, b):
        for declared in dataclasses.fields(record_cls):
            name, layout = declared.name, layout_of(declared)
            got, x, y = getattr(whole, name), getattr(a, name), getattr(b, name)
            if declared.metadata.get("record") is not None:
                check(declared.metadata["record"], got, x, y)
            elif layout == WHOLE:
                merge = declared.metadata.get("merge")
                assert same(got, merge([x, y]) if merge else x), name
            elif not isinstance(x, torch.Tensor):
                assert got == x + y, name
            elif layout == ROWS:
                assert same(got, torch.cat([x, y])), name
            else:
                pad = PAD_ID if declared.metadata["pad"] == PAD_TOKEN else declared.metadata["pad"]
                width = max(x.shape[1], y.shape[1])
                assert same(got, torch.cat([padded(x, width, pad), padded(y, width, pad)])), name

    check(cls, joined, first, second)
    assert same(cls.concatenate([first], pad_id=PAD_ID), first)


@pytest.mark.parametrize("cls", [Rollout])
def test_a_part_without_a_field_drops_it_or_stands_for_what_the_field_says(cls):
    first, second = made(cls, 2, 3, "a", 0), made(cls, 3, 5, "b", 10)
    optional = [f for f in dataclasses.fields(cls) if f.default is None or "None" in str(f.type)]
    assert optional
    for declared in optional:
        lacking = dataclasses.replace(second, **{declared.name: None})
        got = getattr(cls.concatenate([first, lacking], pad_id=PAD_ID), declared.name)
        absent = declared.metadata.get("absent")
        if absent is None:
            assert got is None, declared.name
        else:
            stands_for = absent(lacking)
            assert same(got[2:, : stands_for.shape[1]], stands_for), declared.name
        assert getattr(cls.concatenate([dataclasses.replace(first, **{declared.name: None}), lacking]),
                       declared.name) is None


def test_a_rollouts_rows_are_its_selection_cut_to_their_longest_completion():
    rollout = made(Rollout, 4, 6, "a", 0)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    rollout = dataclasses.replace(rollout, completion_mask=mask)
    part = rollout.rows(1, 3)
    for declared in dataclasses.fields(Rollout):
        value = getattr(rollout, declared.name)[1:3]
        if layout_of(declared) == COMPLETION:
            value = value[:, :3]
        assert same(getattr(part, declared.name), value), declared.name


@pytest.mark.parametrize("cls", RECORDS)
def test_the_state_gives_back_every_kept_field(cls):
    record = made(cls, 3, 4, "a", 0)
    back = cls.from_state(record.state())
    for declared in dataclasses.fields(cls):
        kept = declared.metadata["state"]
        want = getattr(record, declared.name) if kept else declared.default
        assert same(getattr(back, declared.name), want), declared.name


def test_a_checkpoint_written_before_loads():
    """The state as `batch_state` wrote it (a checkpoint's pending rollouts, a message between ranks), one from
    before routing replay without `routed_experts`: the same keys still written, and read back."""
    batch = made(Batch, 3, 4, "a", 0)
    rollout = batch.rollout
    old = {"rows": batch.rows, "prompt_ids": batch.prompt_ids, "completions": batch.completions,
           "completion_ids": rollout.completion_ids, "completion_mask": rollout.completion_mask,
           "logprobs": rollout.logprobs, "finish_reasons": rollout.finish_reasons, "tool_mask": rollout.tool_mask,
           "routed_experts": rollout.routed_experts, "rollout_metrics": batch.rollout_metrics}
    state = batch.state()
    assert set(old) <= set(state) and all(same(state[key], value) for key, value in old.items())
    back = Batch.from_state(old)
    assert same(back.rollout, rollout) and back.rows == batch.rows and back.rollout_metrics == batch.rollout_metrics
    older = Batch.from_state({key: value for key, value in old.items() if key != "routed_experts"})
    assert older.rollout.routed_experts is None and same(older.rollout.completion_ids, rollout.completion_ids)


def test_a_nested_records_state_names_no_field_twice():
    outer = {f.name for f in dataclasses.fields(Batch) if f.metadata["record"] is None}
    inner = {f.name for f in dataclasses.fields(Rollout)}
    assert not outer & inner
