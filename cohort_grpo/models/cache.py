"""`KVCache`: preallocated key/value storage for incremental decoding.

A key and a value tensor per layer, `[rows, kv_heads, max_len, head_dim]`, allocated once so
a decode step writes in place and has static shapes (a CUDA graph can capture it). A *row* is one
sequence slot; the sampler decides which sequence lives in which row (`cache_rows` in
`CausalLM.forward`) and at which positions its tokens go (`position_ids`).

A mixture-of-experts model's cache may also keep each position's chosen experts (`routes`), written
and moved with the keys, so the sampler can hand the trainer the routing it sampled with
(routing replay, `cohort_grpo/models/moe.py`).

A model with recurrent layers (Gated DeltaNet, Mamba, short convolutions) keeps their recurrent states per row too
(`recurrent`, recurrent_state.py): a compaction moves them with the keys, and the completions of a prompt take its
state after the prompt.
"""

from __future__ import annotations

import torch

from cohort_grpo.models.recurrent_state import RecurrentStates, StateShapes


class KVCache:
    """Keys and values of every layer, layer l's `k_layers[l]`/`v_layers[l]` shaped `[rows, kv_heads, max_len,
    head_dim]`: one (kv_heads, head_dim) for every layer, or each layer's own where `layer_shapes` gives them (models
    whose local and global layers differ, e.g. Gemma 4's wider global heads)."""

    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 route_shape: tuple[int, int] | None = None,
                 layer_shapes: tuple[tuple[int, int], ...] | None = None, state_shapes: StateShapes | None = None):
        # One allocation per layer rather than one 5-D tensor: a layer's cache is then a base
        # tensor, not a view, so torch.compile can write it in place (an in-place write into a
        # view of a graph input is functionalised into a copy of the whole base).
        if layer_shapes is None:
            layer_shapes = ((num_kv_heads, head_dim),) * num_layers
        if len(layer_shapes) != num_layers:
            raise ValueError(f"layer_shapes has {len(layer_shapes)} entries for {num_layers} layers")
        shapes = [(num_rows, heads, max_len, width) for heads, width in layer_shapes]
        self.k_layers = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.v_layers = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        # Row r's keys and values below position prefix_lens[r] are also in row prefix_rows[r]
        # (a prompt shared by several sequences, see share_prefix); the decode kernel reads them
        # there, so the rows of one prompt read one copy. Every row also keeps its own copy.
        self.own_row_ids = torch.arange(num_rows, dtype=torch.int32, device=device)
        self.prefix_rows = self.own_row_ids.clone()
        self.prefix_lens = torch.zeros(num_rows, dtype=torch.int32, device=device)
        # A row's rotary position at cache position p is p + rotary_offsets[row]: 0 but for a vision-language
        # prompt whose image tokens take fewer positions than tokens (Qwen-VL's multimodal rotary positions)
        self.rotary_offsets = torch.zeros(num_rows, dtype=torch.long, device=device)
        # route_shape (MoE layers, k): the expert ids of each row's token at each position, int16
        self.routes = None if route_shape is None else torch.zeros(
            (num_rows, max_len, *route_shape), dtype=torch.int16, device=device)
        # state_shapes (recurrent layers, whose keys and values are empty unless they also attend): each row's states
        self.recurrent = None if not state_shapes else RecurrentStates(state_shapes, num_rows, dtype, device)

    @property
    def k(self) -> torch.Tensor:
        """All keys `[layers, rows, kv_heads, max_len, head_dim]` (a stacked copy, for inspection; layers of one
        shape only)."""
        return torch.stack(self.k_layers)

    @property
    def v(self) -> torch.Tensor:
        return torch.stack(self.v_layers)

    @classmethod
    def for_model(cls, model, num_rows: int, max_len: int, dtype: torch.dtype | None = None,
                  record_routes: bool = True) -> "KVCache":
        """A cache shaped for `model` (a `CausalLM`, or a `TransformersCausalLM`: its probed geometry), on its
        device and in its dtype unless given; for a mixture-of-experts `CausalLM` it records the routes too unless
        `record_routes` is False."""
        layer_shapes = getattr(model, "kv_cache_layer_shapes", None)  # a TransformersCausalLM's, probed (generic.py)
        if layer_shapes is not None:
            (kv_heads, head_dim), layers = layer_shapes[0], len(layer_shapes)
            return cls(layers, num_rows, kv_heads, max_len, head_dim, dtype=dtype or model.dtype, device=model.device,
                       layer_shapes=layer_shapes, state_shapes=getattr(model, "recurrent_state_shapes", None))
        config = model.config
        sparse = len(config.sparse_layers) if getattr(config, "num_experts", 0) else 0
        route_shape = (sparse, config.num_experts_per_tok) if sparse and record_routes else None
        return cls(config.num_hidden_layers, num_rows, config.num_key_value_heads, max_len, config.head_dim,
                   dtype=dtype or model.dtype, device=model.device, route_shape=route_shape)

    @property
    def num_layers(self) -> int:
        return len(self.k_layers)

    @property
    def num_rows(self) -> int:
        return self.k_layers[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k_layers[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k_layers[0].device

    def nbytes(self) -> int:
        states = 0 if self.recurrent is None else self.recurrent.nbytes()
        return 2 * sum(keys.numel() for keys in self.k_layers) * self.k_layers[0].element_size() + states

    def step_states(self) -> list[torch.Tensor]:
        """What a decode step advances rather than rewrites (the rows' recurrent states): a CUDA graph's warm-up and
        check runs must put them back (rollout/cuda_graphs.py)."""
        return [] if self.recurrent is None else list(self.recurrent.tensors.values())

    def move_rows(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy cache rows `source` to rows `target` in every layer (the sampler's compaction).
        Every row reads its own prefix again afterwards: the moved rows' sources may be overwritten."""
        for keys, values in zip(self.k_layers, self.v_layers):
            keys[target] = keys[source]
            values[target] = values[source]
        if self.routes is not None:
            self.routes[target] = self.routes[source]
        if self.recurrent is not None:
            self.recurrent.copy_rows(source, target)
        self.rotary_offsets[target] = self.rotary_offsets[source]
        self.prefix_rows.copy_(self.own_row_ids)
        self.prefix_lens.zero_()

    def own_rows(self, rows: torch.Tensor) -> None:
        """`rows` are about to be rewritten (a prefill): they, and every row that read its prefix
        from one of them, read their own keys again."""
        stale = torch.isin(self.prefix_rows, rows.to(self.prefix_rows.dtype))
        stale[rows] = True
        self.rotary_offsets[rows] = 0  # a vision-language prefill sets its rows' own
        self.prefix_rows.copy_(torch.where(stale, self.own_row_ids, self.prefix_rows))
        self.prefix_lens.masked_fill_(stale, 0)

    def share_prefix(self, source: torch.Tensor, target: torch.Tensor, copy_length: int,
                     prefix_lens: torch.Tensor) -> None:
        """Rows `target` hold the same prompt as rows `source`: copy positions [0, copy_length) of
        each source row to its target in every layer, and let the targets read their first
        `prefix_lens` keys from the source row (positions the completion never rewrites). Recurrent states are
        copied whole: a source row's is its state after the prompt (prefill.py runs such prompts unpadded)."""
        for keys, values in zip(self.k_layers, self.v_layers):
            keys[target, :, :copy_length] = keys[source, :, :copy_length]
            values[target, :, :copy_length] = values[source, :, :copy_length]
        if self.routes is not None:
            self.routes[target, :copy_length] = self.routes[source, :copy_length]
        if self.recurrent is not None:
            self.recurrent.copy_rows(source, target)
        self.rotary_offsets[target] = self.rotary_offsets[source]
        self.prefix_rows[target] = source.to(self.prefix_rows.dtype)
        self.prefix_lens[target] = prefix_lens.to(self.prefix_lens.dtype)

    def write(self, layer: int, cache_rows: torch.Tensor | None, position_ids: torch.Tensor,
              keys: torch.Tensor, values: torch.Tensor, write_mask: torch.Tensor | None = None) -> None:
        """Store `keys`/`values` `[B, kv_heads, T, head_dim]` of batch row b, token t at
        `[cache_rows[b], :, position_ids[b, t]]` of the layer's cache (`cache_rows` None: row b).
        Where `write_mask[b, t]` is 0 (a pad token) the slot keeps its old content. In place, static
        shapes, no host sync, so it can run inside a CUDA graph (and under torch.compile, as one
        in-place index_put per tensor)."""
        if cache_rows is None:
            cache_rows = torch.arange(keys.shape[0], device=position_ids.device)
        rows = cache_rows[:, None].expand_as(position_ids)
        layer_k, layer_v = self.k_layers[layer], self.v_layers[layer]
        new_k, new_v = keys.transpose(1, 2), values.transpose(1, 2)  # [B, T, kv_heads, head_dim]
        if write_mask is not None:
            keep_new = write_mask.bool()[:, :, None, None]
            new_k = torch.where(keep_new, new_k, layer_k[rows, :, position_ids])
            new_v = torch.where(keep_new, new_v, layer_v[rows, :, position_ids])
        # advanced indices on dims 0 and 2 put the broadcast [B, T] dims first: value is [B, T, H, D]
        layer_k[rows, :, position_ids] = new_k.to(layer_k.dtype)
        layer_v[rows, :, position_ids] = new_v.to(layer_v.dtype)

    def write_routes(self, moe_layer: int, cache_rows: torch.Tensor | None, position_ids: torch.Tensor,
                     expert_ids: torch.Tensor, write_mask: torch.Tensor | None = None) -> None:
        """Store the expert ids [B, T, k] of MoE layer `moe_layer` where `write` stores keys (same rows,
        positions and mask; in place, no host sync)."""
        if cache_rows is None:
            cache_rows = torch.arange(expert_ids.shape[0], device=position_ids.device)
        rows = cache_rows[:, None].expand_as(position_ids)
        new = expert_ids.to(self.routes.dtype)
        if write_mask is not None:
            new = torch.where(write_mask.bool()[:, :, None], new, self.routes[rows, position_ids, moe_layer])
        self.routes[rows, position_ids, moe_layer] = new

    def keys_values(self, layer: int, cache_rows: torch.Tensor | None, batch: int,
                    cache_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[batch, kv_heads, cache_len, head_dim]` of the given cache rows. With
        `cache_rows` None (rows 0..batch-1, the decode case) they are views of the cache, so a decode
        step reads each cached key once instead of copying the rows first."""
        keys, values = self.k_layers[layer][:, :, :cache_len], self.v_layers[layer][:, :, :cache_len]
        if cache_rows is None:
            return keys[:batch], values[:batch]
        return keys.index_select(0, cache_rows), values.index_select(0, cache_rows)
