"""`KVCache`: preallocated key/value storage for incremental decoding.

One tensor pair for all layers, `[layers, rows, kv_heads, max_len, head_dim]`, allocated once so
a decode step writes in place and has static shapes (a CUDA graph can capture it). A *row* is one
sequence slot; the sampler decides which sequence lives in which row (`cache_rows` in
`CausalLM.forward`) and at which positions its tokens go (`position_ids`).
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer, `k`/`v` shaped `[layers, rows, kv_heads, max_len, head_dim]`."""

    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        shape = (num_layers, num_rows, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, model, num_rows: int, max_len: int, dtype: torch.dtype | None = None) -> "KVCache":
        """A cache shaped for `model` (a `CausalLM`), on its device and in its dtype unless given."""
        config = model.config
        return cls(config.num_hidden_layers, num_rows, config.num_key_value_heads, max_len, config.head_dim,
                   dtype=dtype or model.dtype, device=model.device)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_rows(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, cache_rows: torch.Tensor | None, position_ids: torch.Tensor,
              keys: torch.Tensor, values: torch.Tensor, write_mask: torch.Tensor | None = None) -> None:
        """Store `keys`/`values` `[B, kv_heads, T, head_dim]` of batch row b, token t at
        `[layer, cache_rows[b], :, position_ids[b, t]]` (`cache_rows` None: row b). Where
        `write_mask[b, t]` is 0 (a pad token) the slot keeps its old content. In place, static
        shapes, no host sync, so it can run inside a CUDA graph."""
        if cache_rows is None:
            self._scatter(self.k[layer, : keys.shape[0]], position_ids, keys, write_mask)
            self._scatter(self.v[layer, : values.shape[0]], position_ids, values, write_mask)
            return
        rows = cache_rows[:, None].expand_as(position_ids)
        new_k, new_v = keys.transpose(1, 2), values.transpose(1, 2)  # [B, T, kv_heads, head_dim]
        if write_mask is not None:
            keep_new = write_mask.bool()[:, :, None, None]
            new_k = torch.where(keep_new, new_k, self.k[layer][rows, :, position_ids])
            new_v = torch.where(keep_new, new_v, self.v[layer][rows, :, position_ids])
        # advanced indices on dims 0 and 2 put the broadcast [B, T] dims first: value is [B, T, H, D]
        self.k[layer][rows, :, position_ids] = new_k.to(self.k.dtype)
        self.v[layer][rows, :, position_ids] = new_v.to(self.v.dtype)

    @staticmethod
    def _scatter(rows_view: torch.Tensor, position_ids: torch.Tensor, new: torch.Tensor,
                 write_mask: torch.Tensor | None) -> None:
        """rows_view [B, kv_heads, max_len, head_dim] (a view of the cache) gets new [B, kv_heads, T,
        head_dim] at positions position_ids [B, T] along its length axis, written in place."""
        index = position_ids[:, None, :, None].expand(new.shape)
        new = new.to(rows_view.dtype)
        if write_mask is not None:
            new = torch.where(write_mask.bool()[:, None, :, None], new, rows_view.gather(2, index))
        rows_view.scatter_(2, index, new)

    def keys_values(self, layer: int, cache_rows: torch.Tensor | None, batch: int,
                    cache_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[batch, kv_heads, cache_len, head_dim]` of the given cache rows. With
        `cache_rows` None (rows 0..batch-1, the decode case) they are views of the cache, so a decode
        step reads each cached key once instead of copying the rows first."""
        keys, values = self.k[layer, :, :, :cache_len], self.v[layer, :, :, :cache_len]
        if cache_rows is None:
            return keys[:batch], values[:batch]
        return keys.index_select(0, cache_rows), values.index_select(0, cache_rows)
