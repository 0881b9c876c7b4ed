"""Causal attention with one reduction order for a query, in a decode step and in a full forward.

The fast path attends in two ways: a training or prefill forward through SDPA (FlashAttention or
cuDNN, whose key blocks and query tiles depend on the sequence length) and a decode step through
split-K flash-decoding (`decode_attention.py`, whose split of the key axis depends on the batch and
the cache length). The same query therefore sums its keys in different orders on the two sides.

Here one kernel serves both. A program takes BLOCK_M queries of one (row, head) and walks the keys
from index 0 in blocks of BLOCK_N aligned to index 0, keeping an online softmax (Milakov &
Gimelshein 2018; FlashAttention, Dao et al. 2022) in float32: m (running max, base 2), l (sum of
exponentials) and the output accumulator. Query i sees the keys j ≤ limit[i] (and j > limit[i] −
window with a sliding window), where limit is its index in the row: its position in a cache row,
or in a [prompt | completion] attention row. A block in which a query sees no key leaves its state
bit for bit unchanged (the max stays, the rescale factor is exp2(0) = 1, the added terms are 0), so
the blocks that other queries of the program need change nothing for this one; the blocks it does
see are the same blocks, at the same offsets, with the same tile shapes (`BLOCK_M`, `BLOCK_N`,
warps: constants, never chosen by size), whether it is the one query of a decode step or one of
thousands in a training row. The key axis is never split. In a decode step (one query per row)
the tile's rows are the query heads that share a kv head instead of one head's positions: each cached key is read once per kv head, and a row's arithmetic is unchanged (its own
limit, the same blocks and tile shapes: the rows of a tile do not mix). So its output is the same bits on both
sides (the batch-invariance of Thinking Machines Lab, He et al. 2025, "Defeating Nondeterminism in
LLM Inference", applied across decode and prefill).

`attention` is the autograd entry: the kernel forward, the backward by recomputation through
torch's SDPA (a gradient need not be bit-exact). `attention_reference` is the float32 definition.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cohort_grpo.kernels.triton_common import MAX_COMBINE, MIN_COMBINE, SUM_COMBINE, tl, triton  # noqa: F401
from cohort_grpo.kernels.triton_common import jit as _jit

BLOCK_M = 16  # queries per program: tl.dot's smallest tile, so a decode step wastes least
BLOCK_N = 64  # keys per block
NUM_WARPS = 4
NUM_STAGES = 2
LOG2_E = 1.4426950408889634


@_jit
def _attend_block(q, k_ptrs, v_ptrs, dims_ok, start, limit, lowest, hi, m_i, l_i, acc, stride_kn, stride_vn,
                  scale_log2, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, WIDEN: tl.constexpr):
    """Keys [start, start + BLOCK_N) folded into each query's online softmax (m_i, l_i, acc)."""
    keys = start + tl.arange(0, BLOCK_N)
    loaded = keys < hi
    k = tl.load(k_ptrs + keys[:, None] * stride_kn, mask=loaded[:, None] & dims_ok, other=0.0)
    v = tl.load(v_ptrs + keys[:, None] * stride_vn, mask=loaded[:, None] & dims_ok, other=0.0)
    if WIDEN:  # the interpreter's tl.dot cannot multiply bf16: widen (exact) before it
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale_log2
    else:
        scores = tl.dot(q, tl.trans(k)) * scale_log2
    visible = (keys[None, :] <= limit[:, None]) & loaded[None, :]
    if HAS_WINDOW:
        visible = visible & (keys[None, :] >= lowest[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(scores, 1, MAX_COMBINE))
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: no -inf - -inf
    p = tl.exp2(scores - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
    if WIDEN:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@_jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, limit_ptr, out_ptr,
                      stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                      stride_vn, stride_lb, stride_lt, stride_ob, stride_oh, stride_ot,
                      num_queries, num_keys, window, scale_log2,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, WIDEN: tl.constexpr, PIPELINED: tl.constexpr,
                      PACKED_HEADS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)  # a head dim that is not a power of two: zeros in the padded lanes add nothing
    dims_ok = offs_d[None, :] < HEAD_DIM
    if PACKED_HEADS:  # one query a row (a decode step): the tile's rows are the query heads of one kv head
        kv_head = tl.program_id(1).to(tl.int64)
        heads = kv_head * GROUP + offs_m
        real = offs_m < GROUP
        q_rows = heads * stride_qh
        limit_rows = offs_m * 0
        out_rows = heads * stride_oh
    else:  # the tile's rows are BLOCK_M query positions of one head
        head = tl.program_id(1).to(tl.int64)
        kv_head = head // GROUP
        real = offs_m < num_queries
        q_rows = head * stride_qh + offs_m * stride_qt
        limit_rows = offs_m * stride_lt
        out_rows = head * stride_oh + offs_m * stride_ot
    limit = tl.load(limit_ptr + row * stride_lb + limit_rows, mask=real, other=-1).to(tl.int32)
    q = tl.load(q_ptr + row * stride_qb + q_rows[:, None] + offs_d[None, :], mask=real[:, None] & dims_ok, other=0.0)
    k_ptrs = k_ptr + row * stride_kb + kv_head * stride_kh + offs_d[None, :]
    v_ptrs = v_ptr + row * stride_vb + kv_head * stride_vh + offs_d[None, :]
    lowest = limit - window + 1
    hi = tl.minimum(tl.reduce(limit, 0, MAX_COMBINE) + 1, num_keys)
    start = 0
    if HAS_WINDOW:  # blocks below every query's window change nothing: skip them (block-aligned)
        first = tl.reduce(tl.where(real, lowest, 2147483647), 0, MIN_COMBINE)
        start = (tl.maximum(first, 0) // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    if PIPELINED:
        for block in range(start, hi, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, k_ptrs, v_ptrs, dims_ok, block, limit, lowest, hi, m_i, l_i, acc,
                                          stride_kn, stride_vn, scale_log2, BLOCK_N, HAS_WINDOW, WIDEN)
    else:  # the interpreter cannot run range() with a bound read from memory
        block = start
        while block < hi:
            m_i, l_i, acc = _attend_block(q, k_ptrs, v_ptrs, dims_ok, block, limit, lowest, hi, m_i, l_i, acc,
                                          stride_kn, stride_vn, scale_log2, BLOCK_N, HAS_WINDOW, WIDEN)
            block += BLOCK_N
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row * stride_ob + out_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=real[:, None] & dims_ok)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: torch.Tensor,
                      window: int | None = None, scale: float | None = None, packed_heads: bool = True
                      ) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, H_kv, S, D] (any strides but unit stride along D), limits [B, T] integers:
    query t of row b sees keys j with j ≤ limits[b, t] (and j > limits[b, t] − window), j < S; query
    head h uses kv head h // (H / H_kv). Returns [B, H, T, D] in q's dtype. With T = 1 a kv head's query
    heads share a program (`packed_heads`; False: one program per head, the same bits, for comparison)."""
    if triton is None:
        raise RuntimeError("the exact attention kernel needs triton")
    batch, heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    if heads % kv_heads or v.shape != k.shape or k.shape[0] != batch or limits.shape != (batch, length):
        raise ValueError(f"exact attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"limits {tuple(limits.shape)} do not fit together")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(batch, heads, length, dim, dtype=q.dtype, device=q.device)
    if not (batch and length):
        return out
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    group = heads // kv_heads
    launch = dict(GROUP=group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=dim,
                  BLOCK_D=max(16, triton.next_power_of_2(dim)), HAS_WINDOW=window is not None,
                  WIDEN=not q.is_cuda, PIPELINED=q.is_cuda, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    packed = length == 1 and packed_heads  # a decode step: the query heads of a kv head share one tile
    grid = (batch, kv_heads, triton.cdiv(group, BLOCK_M)) if packed else (batch, heads, triton.cdiv(length, BLOCK_M))
    _attention_kernel[grid](
        q, k, v, limits, out, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), limits.stride(0), limits.stride(1), out.stride(0), out.stride(1),
        out.stride(2), length, keys, 0 if window is None else window, scale * LOG2_E, PACKED_HEADS=packed, **launch)
    return out


def visible_keys(limits: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """Bool [B, 1, T, S]: whether query t of row b sees key j (the kernel's rule)."""
    keys = torch.arange(num_keys, device=limits.device)
    visible = keys <= limits[:, :, None]
    if window is not None:
        visible = visible & (keys > limits[:, :, None] - window)
    return visible[:, None]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: torch.Tensor,
                        window: int | None = None, causal: bool = False) -> torch.Tensor:
    """The kernel's definition through SDPA in q's dtype (differentiable): what the backward recomputes.
    `causal`: the caller's word that limits[b] = 0..T-1 and S = T (then SDPA's mask-free kernel)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if causal and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible_keys(limits, k.shape[2], window))


class ExactAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, limits, window, causal):
        ctx.save_for_backward(q, k, v, limits)
        ctx.window, ctx.causal = window, causal
        return attention_forward(q, k, v, limits, window)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, limits = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = attention_reference(*leaves, limits, ctx.window, ctx.causal)
            grads = torch.autograd.grad(out, leaves, grad_out)
        return (*grads, None, None, None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limits: torch.Tensor,
              window: int | None = None, causal: bool = False) -> torch.Tensor:
    """`attention_forward` (differentiable: the backward recomputes `attention_reference`; `causal` as there)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return ExactAttention.apply(q, k, v, limits, window, causal)
    return attention_forward(q, k, v, limits, window)
