"""Attention for a flat batch of tokens in which each prompt appears once for all its completions.

`cohort_grpo/update/packing.py`'s shared-prompt layout gives the model one flat sequence: each prompt's tokens
once, then each of its completions' tokens, no padding. Everything in a decoder layer but attention
works token by token, so the GEMMs, norms and MLP see each prompt once. Attention needs each
completion next to its prompt: `attention_rows` [b, L] lists, for completion i, the flat indices of
[its prompt | itself] (then any index as padding, which causal attention never reads from a real
token), so queries, keys and values are gathered into b plain causal rows and attention runs
through SDPA's mask-free (flash) kernel, as in the one-row-per-completion layout. Each flat token's
output is then read back from one slot (`attention_slots` [N]): a completion token from its own
row, a prompt token from its group's first row (every row of the group computes the same prompt
outputs; the copies are dropped, so their gradient is zero and the keys' and values' gradients sum
over the group through the gather).

What is repeated per completion is the prompt queries' attention only, a few percent of a layer's
FLOPs; FlexAttention's document masks would avoid even that, but its backward ran so much slower than
cuDNN's (docs/history/benchmarks-2026-11.md, "Shared-prompt packing") that it cost more than the whole saving.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PackedRows(NamedTuple):
    """The attention rows of a shared-prompt forward (what `grouped_query_attention` gets as its mask)."""

    rows: torch.Tensor  # [b, L] long: flat token index of each position of each attention row
    slots: torch.Tensor  # [N] long: the position in rows.view(-1) whose output each flat token takes
    mask: torch.Tensor | None  # None (causal) or a bool [1, 1, L, L] sliding-window causal mask


def is_packed(mask) -> bool:
    return isinstance(mask, PackedRows)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedRows, attend) -> torch.Tensor:
    """q [1, H, N, D], k/v [1, H_kv, N, D] over flat tokens → [1, H, N, D]: `attend(q, k, v, mask)`
    (grouped-query SDPA) on the gathered rows [b, H, L, D], read back per token."""
    def to_rows(x):  # [1, h, N, D] -> [b, h, L, D]
        return x[0].transpose(0, 1)[packed.rows].transpose(1, 2)

    out = attend(to_rows(q), to_rows(k), to_rows(v), packed.mask)  # [b, H, L, D]
    heads, dim = out.shape[1], out.shape[3]
    flat = out.transpose(1, 2).reshape(-1, heads, dim)[packed.slots]  # [N, H, D]
    return flat.transpose(0, 1)[None]
