"""The decoder's forward under `numerics="exact"`: every token's arithmetic independent of the batch.

With exact numerics (`CausalLM.set_numerics("exact")`, the run's `rollout_numerics`), the engine's
prefill and CUDA-graph decode steps and the trainer's full-sequence forwards (π_old, π_θ with its
gradient, π_ref; padded rows or each prompt once; micro-batched; checkpointed) compute a token's
hidden state with the same sequence of floating-point operations, so the sampler's log-prob of a
token and the trainer's are the same bits:

- every matrix product goes through the batch-invariant kernel (`kernels/exact_matmul.py`), fused
  q/k/v or gate/up included (a column's bits do not depend on the other columns);
- RMSNorm (the layers', the final one, Qwen3's per-head q/k norms) through the one-row-per-program
  kernel (`kernels/exact_rms_norm.py`);
- attention through the one kernel of `kernels/exact_attention.py` for a decode step (one query
  against the KV cache) and a full forward (causal rows, or the shared-prompt attention rows);
- rotary cos/sin looked up in one table per (device, dtype), computed once: the same bits for a
  position whatever the call (a CPU's vectorised cos may round its loop's tail otherwise);
- the rotary embedding (with a decode step's cache write) and SiLU·mul by one kernel each
  (`kernels/exact_elementwise.py`), the residual adds as plain torch adds, on both sides: no
  torch.compile and none of the sampling path's fused pieces;
- the LM head by the same matmul, its log-softmax by `kernels/logprobs.py` on both sides (the
  engine's recorded log-prob is computed from the logits it sampled from: `rollout/token_sampler.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cohort_grpo.config.choices import CHOICES
from cohort_grpo.errors import CohortError
from cohort_grpo.kernels import exact_attention, exact_elementwise, exact_matmul, exact_rms_norm
from cohort_grpo.models import shared_prefix

NUMERICS = CHOICES["rollout_numerics"]  # the one table of allowed values


class ExactMask(NamedTuple):
    """What an exact attention layer gets in place of a mask."""

    limits: torch.Tensor  # [B, T] (or [b, L] for packed rows): query t sees keys j <= limits[.., t]
    window: int | None  # sliding window, None for full causal attention
    causal: bool  # limits are 0..T-1 over the forward's own keys (the backward may use SDPA's causal kernel)
    packed: shared_prefix.PackedRows | None = None  # the shared-prompt layout's attention rows


def check_numerics(numerics: str) -> None:
    if numerics not in NUMERICS:
        raise CohortError(f"numerics={numerics!r} is not one of {', '.join(NUMERICS)}; pass fast or exact "
                          "(--rollout_numerics)")


def linear(module, x: torch.Tensor) -> torch.Tensor:
    """An nn.Linear's product through the batch-invariant kernel."""
    return exact_matmul.linear(x, module.weight, module.bias)


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    return exact_rms_norm.rms_norm(x, norm.weight, norm.eps)


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """`model.lm_head(hidden)`, through the batch-invariant kernel when the model's numerics are exact."""
    if getattr(model, "numerics", "fast") == "exact":
        return exact_matmul.linear(hidden, model.lm_head.weight, model.lm_head.bias)
    return model.lm_head(hidden)


def rotary_table(rotary, position_ids: torch.Tensor, dtype: torch.dtype, max_positions: int):
    """(cos, sin) [B, T, head_dim] of `rotary` (a RotaryEmbedding) at `position_ids`, read from a table of
    every position below `max_positions`, built on the first call for this device and dtype (outside a
    CUDA graph: the engine's eager prefill always comes first)."""
    key = (position_ids.device, dtype)
    tables = rotary.exact_tables
    if key not in tables:
        positions = torch.arange(max_positions, device=position_ids.device)[None]
        tables[key] = rotary.compute(positions, dtype)
    cos, sin = tables[key]
    return cos[0][position_ids], sin[0][position_ids]


def masks(input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask, kv_cache, attention_rows,
          attention_slots, windows: set) -> dict:
    """The `ExactMask` of each sliding window (None: full attention) for a forward of `CausalLM`."""
    batch, length = input_ids.shape
    device = input_ids.device
    if kv_cache is not None:  # a cache slot is a position: a query sees the keys at positions <= its own
        return {w: ExactMask(position_ids, w, causal=False) for w in windows}
    if attention_mask is not None:
        raise CohortError("numerics=exact: a padded full forward (attention_mask) is not supported; pad on the "
                          "right without a mask (as the trainer does) or use numerics=fast")
    if attention_rows is not None:
        rows_length = attention_rows.shape[1]
        limits = torch.arange(rows_length, device=device).expand(attention_rows.shape[0], rows_length)
        packed = shared_prefix.PackedRows(attention_rows, attention_slots, None)
        return {w: ExactMask(limits, w, causal=True, packed=packed) for w in windows}
    limits = torch.arange(length, device=device).expand(batch, length)
    return {w: ExactMask(limits, w, causal=True) for w in windows}


def attention_forward(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: ExactMask, kv_cache=None,
                      cache_rows=None, position_ids=None, write_mask=None, cache_len=None, decode_kernel=False):
    """`Attention.forward` in exact numerics (the same arguments; `mask` an `ExactMask`)."""
    batch, length, _ = x.shape
    q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    fused = attn.fused_qkv
    if fused is not None and not torch.is_grad_enabled() and fused[0].data_ptr() == attn.q_proj.weight.data_ptr():
        q, k, v = exact_matmul.linear(x, *fused).split([q_size, kv_size, kv_size], dim=-1)
    else:
        q, k, v = linear(attn.q_proj, x), linear(attn.k_proj, x), linear(attn.v_proj, x)
    q = q.reshape(batch, length, attn.num_heads, attn.head_dim)
    k = k.reshape(batch, length, attn.num_kv_heads, attn.head_dim)
    v = v.reshape(batch, length, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = exact_elementwise.rotate(q.transpose(1, 2), cos, sin)
    if kv_cache is not None and cache_rows is None and write_mask is None:
        # rows 0..B-1 unmasked (a decode step): rotated keys and the values go straight into the cache
        exact_elementwise.rotate_kernel(k.transpose(1, 2), cos, sin, kv_cache.k_layers[attn.layer_index],
                                        position_ids)
        exact_elementwise.rotate_kernel(v, None, None, kv_cache.v_layers[attn.layer_index], position_ids)
    else:
        k = exact_elementwise.rotate(k.transpose(1, 2), cos, sin)
        if kv_cache is not None:
            kv_cache.write(attn.layer_index, cache_rows, position_ids, k, v, write_mask)
    if kv_cache is not None:
        k, v = kv_cache.keys_values(attn.layer_index, cache_rows, batch, cache_len)
        out = exact_attention.attention(q, k, v, mask.limits, mask.window)
    elif mask.packed is not None:
        def attend(rows_q, rows_k, rows_v, _mask):
            return exact_attention.attention(rows_q, rows_k, rows_v, mask.limits, mask.window, causal=True)

        out = shared_prefix.packed_attention(q, k, v, mask.packed, attend)
    else:
        out = exact_attention.attention(q, k, v, mask.limits, mask.window, causal=True)
    return linear(attn.o_proj, out.transpose(1, 2).reshape(batch, length, -1))


def mlp_forward(mlp, x: torch.Tensor) -> torch.Tensor:
    """`MLP.forward` in exact numerics."""
    fused = mlp.fused_gate_up
    if fused is not None and not torch.is_grad_enabled() and fused[0].data_ptr() == mlp.gate_proj.weight.data_ptr():
        gate, up = exact_matmul.linear(x, *fused).chunk(2, dim=-1)
        if not (gate.is_cuda or mlp.is_silu):
            # A CPU elementwise op runs a scalar loop on strided operands, whose exp may round otherwise
            # than the vectorised loop the separate (contiguous) projections get. CUDA has one code path.
            gate, up = gate.contiguous(), up.contiguous()
    else:
        gate, up = linear(mlp.gate_proj, x), linear(mlp.up_proj, x)
    hidden = exact_elementwise.swiglu_gate(gate, up) if mlp.is_silu else mlp.act(gate) * up
    return linear(mlp.down_proj, hidden)


def check_model(model) -> None:
    """Refuse, in one line, a model whose forward exact numerics do not cover."""
    from torch import nn

    for name, module in model.named_modules():
        if name.endswith(("_proj", "lm_head")) and type(module) is not nn.Linear:
            raise CohortError(f"numerics=exact covers plain linear layers only; {name} is a "
                              f"{type(module).__name__} (LoRA or a tensor-parallel shard): use rollout_numerics=fast")



def use_exact_numerics(model, device: torch.device) -> None:
    """Switch a run's policy to exact numerics, or refuse in one line where they cannot run."""
    import os

    from cohort_grpo.kernels.elementwise import triton_available

    if not hasattr(model, "set_numerics"):
        raise CohortError(f"rollout_numerics=exact needs cohort's own models, and {type(model).__name__} is "
                          "transformers'; use --rollout_numerics fast")
    if getattr(getattr(model, "config", None), "num_experts", 0):
        raise CohortError("rollout_numerics=exact does not cover mixture-of-experts layers yet; use --rollout_numerics "
                          "fast (routing_replay keeps the trainer on the sampler's experts)")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not triton_available() or (device.type != "cuda" and not interpreted):
        raise CohortError(f"rollout_numerics=exact runs Triton kernels on a GPU with triton installed, not on {device}; "
                          "use --rollout_numerics fast (TRITON_INTERPRET=1 runs them on the CPU, slowly, for tests)")
    model.set_numerics("exact")
