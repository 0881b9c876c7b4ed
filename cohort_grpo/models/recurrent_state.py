"""The recurrent state of linear-attention and state-space layers, kept per engine row beside the KV cache.

A layer that keeps a state instead of keys and values (the Gated DeltaNet layers of Qwen3.5 and Qwen3-Next, the
Mamba 1 and 2 mixers of Jamba, Granite 4.0, Falcon-H1, Nemotron-H and Bamba, LFM2's short convolutions) reads and
writes it through transformers' cache interface: `get_conv_state`/`update_conv_state` (the last inputs of its
causal convolution) and `get_recurrent_state`/`update_recurrent_state` (its state matrices), by layer and
`state_idx` (a layer may keep several, each of its own shape and dtype). `RecurrentStates` holds each such state
for every engine row, one tensor [rows, ...] per (layer, kind, index); `KVCache` moves and copies it with its rows.
`StateCache` is what one of `TransformersCausalLM`'s cached forwards passes to the model as its `cache`: batch row
b reads and writes engine row `cache_rows[b]` (row b when None), a row whose first token in the forward is at
position 0 starts from a zero state (a prefill resets its row), and the attention layers' `update` hands their keys
and values back untouched (cohort's attention function caches them). Without `RecurrentStates`
(the wrap-time probe) it serves no state and records the shape and dtype of each state the layers write.

The state after a prompt is the state after its last token: a forward whose rows are right-padded would run the
pad tokens into it, so the engine prefills such a model's prompts in forwards of one length (prefill.py).
"""

from __future__ import annotations

import math

import torch

CONV, RECURRENT = "conv", "recurrent"

# (layer, kind, index) -> (the state's shape without the row dimension, the dtype the layer gave it)
StateShapes = dict[tuple[int, str, int], tuple[tuple[int, ...], torch.dtype]]


def stored_dtype(key: tuple[int, str, int], state_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype `RecurrentStates` keeps the state `key` in: a convolution's inputs in the cache's `dtype`, a state
    matrix in the dtype the layer gave it."""
    return dtype if key[1] == CONV else state_dtype


def row_bytes(shapes: StateShapes, dtype: torch.dtype) -> int:
    """The bytes of one row's states in `RecurrentStates(shapes, rows, dtype)`: what each sequence an engine decodes
    at once holds beside its keys and values, whatever its length (`cohort_grpo.plans` prices it)."""
    return sum(math.prod(shape) * stored_dtype(key, state_dtype, dtype).itemsize
               for key, (shape, state_dtype) in shapes.items())


class RecurrentStates:
    """Every row's recurrent states: `tensors[(layer, kind, index)]` [rows, *shape]. Convolution states hold the
    layer's inputs, in the cache's dtype; the state matrices stay in the dtype the layer computes them in
    (float32 in transformers' kernels), as transformers' own cache keeps them (`stored_dtype`)."""

    def __init__(self, shapes: StateShapes, num_rows: int, dtype: torch.dtype, device=None):
        self.tensors = {key: torch.zeros((num_rows, *shape), device=device,
                                         dtype=stored_dtype(key, state_dtype, dtype))
                        for key, (shape, state_dtype) in shapes.items()}

    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())

    def copy_rows(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Rows `target` take the states of rows `source` (a compaction's moves, or a prompt's state for the other
        completions of its group)."""
        for tensor in self.tensors.values():
            tensor[target] = tensor[source]

    def read(self, key, cache_rows: torch.Tensor | None, batch: int, fresh: torch.Tensor) -> torch.Tensor:
        """A new tensor of the state `key` of each batch row's engine row, zero where `fresh` [batch]."""
        tensor = self.tensors[key]
        stored = tensor[:batch] if cache_rows is None else tensor.index_select(0, cache_rows)
        fresh = fresh.view(-1, *([1] * (stored.dim() - 1)))
        return torch.where(fresh, torch.zeros((), dtype=stored.dtype, device=stored.device), stored)

    def write(self, key, cache_rows: torch.Tensor | None, value: torch.Tensor) -> None:
        """The state `key` of each batch row's engine row becomes `value` [batch, *shape] (in place)."""
        tensor = self.tensors[key]
        if cache_rows is None:
            tensor[: value.shape[0]].copy_(value)
        else:
            tensor.index_copy_(0, cache_rows, value.to(tensor.dtype))


class StateCache:
    """transformers' cache interface over `RecurrentStates` for one forward of the batch rows `cache_rows` at
    `positions` [batch, T] (see the module docstring); `finish()` after the forward writes the convolution states
    back. With `states` None it records the states' shapes (`recorded`) and serves none."""

    is_compileable = False

    def __init__(self, states: RecurrentStates | None, cache_rows: torch.Tensor | None, positions: torch.Tensor):
        self.states, self.cache_rows, self.batch = states, cache_rows, positions.shape[0]
        self.fresh = positions[:, 0] == 0
        self.conv: dict[tuple[int, int], torch.Tensor] = {}  # this forward's convolution states, by (layer, index)
        self.recorded: StateShapes = {}

    # ---- attention layers: cohort's attention function holds their keys and values ----------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return key_states, value_states

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The mask over this forward's own tokens (cohort's mask function builds none during a cached step)."""
        return query_length, 0

    # ---- recurrent layers (linear attention, state space, convolution) ---------------------------------------
    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers counts tokens here; positions come from the engine."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The rows' convolution states [batch, channels, kernel] (zero for fresh rows). A single-token step updates
        this tensor in place; `finish` writes it back."""
        if self.states is None:
            return None
        key = (layer_idx, state_idx)
        if key not in self.conv:
            self.conv[key] = self.states.read((layer_idx, CONV, state_idx), self.cache_rows, self.batch, self.fresh)
        return self.conv[key]

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """The convolution's input [batch, channels, kernel + T]: the rows' kept inputs, then this forward's
        `conv_states` [batch, channels, T]; the last `kernel` of them are kept."""
        if self.states is None:
            kernel = conv_kernel_size or conv_states.shape[-1]
            self.recorded[(layer_idx, CONV, state_idx)] = ((conv_states.shape[1], kernel), conv_states.dtype)
            return conv_states
        kept = self.get_conv_state(layer_idx, state_idx)
        full = torch.cat([kept, conv_states.to(kept.dtype)], dim=-1)
        kept.copy_(full[..., -kept.shape[-1]:])
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if self.states is None:
            return None
        return self.states.read((layer_idx, RECURRENT, state_idx), self.cache_rows, self.batch, self.fresh)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        key = (layer_idx, RECURRENT, state_idx)
        if self.states is None:
            self.recorded[key] = (tuple(recurrent_states.shape[1:]), recurrent_states.dtype)
        else:
            self.states.write(key, self.cache_rows, recurrent_states)
        return recurrent_states

    def finish(self) -> None:
        """Write this forward's convolution states back to the rows."""
        for (layer, index), kept in self.conv.items():
            self.states.write((layer, CONV, index), self.cache_rows, kept)

    def state_layers(self) -> set[int]:
        """The layers whose states the probe recorded."""
        return {layer for layer, _, _ in self.recorded}
