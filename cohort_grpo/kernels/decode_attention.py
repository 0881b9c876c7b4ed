"""Split-K "flash-decoding" attention for one decode step of a grouped-query-attention model.

One decode step has a single query per sequence, so ordinary flash attention (Dao et al. 2022)
gets one program per (row, head) and leaves most of the GPU idle at small batch, while SDPA with
the query heads folded into the query axis still scans every cached key up to the cache length.
Flash-decoding (Dao, Haziza, Massa & Sizov 2023, "Flash-Decoding for long-context inference")
splits each row's key range across programs and merges their partial softmaxes afterwards.

Here one program takes one (row, kv head, split): it loads the whole group of query heads that
share the kv head (so each cached key and value is read once per kv head, not once per query
head), scans only the key blocks of its split that the row can see — blocks past the row's
position are never loaded, so a short row costs less — and keeps an online softmax (Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax"). A second small kernel merges the
splits through their log-sum-exps. The grid depends only on B, H_kv and `cache_len` (Python ints)
and nothing syncs with the host, so the step stays capturable in a CUDA graph.

Rows that share a prompt (GRPO's G completions of one prompt) can read its keys from one cache row
(`prefix_rows` / `prefix_lens`, kept by `KVCache.share_prefix`): their programs then load the same
addresses instead of G copies.

`decode_attention_reference` is the plain-torch float32 definition the kernel is tested against.
"""

from __future__ import annotations

import functools
import math

import torch

from cohort_grpo.kernels.triton_common import MAX_COMBINE, SUM_COMBINE, tl, triton  # triton None: only the reference is usable

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
DEFAULT_SM_COUNT = 132  # H100/H200 SXM, used when no CUDA device can be asked
MIN_GROUP_ROWS = 16  # tl.dot needs every block dimension >= 16
LOG2_E = 1.4426950408889634


def decode_attention_reference(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                               position_ids: torch.Tensor, cache_len: int, window: int | None = None,
                               scale: float | None = None) -> torch.Tensor:
    """Plain float32 attention of each row's query over exactly its visible keys: positions j with
    max(0, p - window + 1) <= j <= p for the row's position p (no lower bound without a window).
    Keys outside that slice are never touched. Returns [B, H, 1, D] in q's dtype."""
    batch, heads, _, head_dim = q.shape
    group = heads // cache_k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty(batch, heads, 1, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        pos = int(position_ids[b, 0])
        hi = min(pos + 1, cache_len)
        lo = 0 if window is None else max(0, pos - window + 1)
        keys = cache_k[b, :, lo:hi].float().repeat_interleave(group, dim=0)  # [H, n, D]
        values = cache_v[b, :, lo:hi].float().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[b, :, 0].float(), keys) * scale
        out[b, :, 0] = torch.einsum("hn,hnd->hd", scores.softmax(dim=-1), values)
    return out.to(q.dtype)


def choose_num_splits(programs_per_split: int, cache_len: int, block_n: int, sm_count: int) -> int:
    """Splits per (row, kv head): enough that about two programs per SM exist, never more than the
    key blocks below `cache_len`, and no trailing split left without keys."""
    blocks = max(1, -(-cache_len // block_n))
    wanted = -(-2 * sm_count // max(1, programs_per_split))
    splits = max(1, min(blocks, wanted))
    blocks_per_split = -(-blocks // splits)
    return -(-blocks // blocks_per_split)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (cached: no device query while a graph captures),
    or H100/H200's count off CUDA, where only the interpreter runs the kernel."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


if triton is not None:

    @triton.jit
    def _row_max(x, axis: tl.constexpr):
        return tl.reduce(x, axis, MAX_COMBINE)

    @triton.jit
    def _row_sum(x, axis: tl.constexpr):
        return tl.reduce(x, axis, SUM_COMBINE)

    @triton.jit
    def _attend_block(q, k_base, v_base, start, lo, hi, m_i, l_i, acc, stride_kn, stride_kd, stride_vn,
                      stride_vd, qk_scale_log2, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
        """One block of BLOCK_N keys from `start` folded into the online softmax (m_i, l_i, acc)."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        keys_at = start + offs_n
        key_mask = (keys_at >= lo) & (keys_at < hi)
        # Masked loads: keys the row cannot see are never read (they may hold anything).
        k = tl.load(k_base + keys_at[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=key_mask[:, None], other=0.0)
        v = tl.load(v_base + keys_at[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=key_mask[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, _row_max(scores, 1))
        # A row of -inf (no visible key yet) would give -inf - -inf = NaN; shift by 0 instead.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + _row_sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _attend_range(q, k_base, v_base, lo, hi, m_i, l_i, acc, stride_kn, stride_kd, stride_vn, stride_vd,
                      qk_scale_log2, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      PIPELINED: tl.constexpr):
        """Keys [lo, hi) of one cache row folded into the online softmax, a block at a time."""
        # Start on a block boundary so loads stay aligned. Split edges are block-aligned, so a
        # range with no visible key (lo >= hi) rounds down to start >= hi: no iteration at all.
        loop_lo = (lo // BLOCK_N) * BLOCK_N
        if PIPELINED:
            # range() lets the compiler prefetch the next block while this one is used (software
            # pipelining); the interpreter (tests on CPU) cannot run it with a runtime bound under
            # NumPy 2.x, so it takes the while loop, which has the same body.
            for start in range(loop_lo, hi, BLOCK_N):
                m_i, l_i, acc = _attend_block(q, k_base, v_base, start, lo, hi, m_i, l_i, acc,
                                              stride_kn, stride_kd, stride_vn, stride_vd, qk_scale_log2,
                                              BLOCK_N, HEAD_DIM, DOT_PRECISION)
        else:
            start = loop_lo
            while start < hi:
                m_i, l_i, acc = _attend_block(q, k_base, v_base, start, lo, hi, m_i, l_i, acc,
                                              stride_kn, stride_kd, stride_vn, stride_vd, qk_scale_log2,
                                              BLOCK_N, HEAD_DIM, DOT_PRECISION)
                start += BLOCK_N
        return m_i, l_i, acc

    @triton.jit
    def _decode_split_kernel(
            q_ptr, k_ptr, v_ptr, pos_ptr, prefix_row_ptr, prefix_len_ptr, part_out_ptr, part_lse_ptr, out_ptr,
            stride_qb, stride_qh, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_pb, stride_ob, stride_oh, stride_od,
            cache_len, keys_per_split, window, num_heads, num_splits, qk_scale_log2,
            GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
            HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PREFIX: tl.constexpr, WRITE_FINAL: tl.constexpr,
            DOT_PRECISION: tl.constexpr, PIPELINED: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        row64 = row.to(tl.int64)

        pos = tl.load(pos_ptr + row64 * stride_pb).to(tl.int32)
        split_lo = split * keys_per_split
        lo = split_lo
        if HAS_WINDOW:
            lo = tl.maximum(lo, pos - window + 1)
        hi = tl.minimum(tl.minimum(pos + 1, cache_len), split_lo + keys_per_split)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, HEAD_DIM)
        group_mask = offs_g < GROUP
        heads = kv_head * GROUP + offs_g
        q_ptrs = q_ptr + row64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=group_mask[:, None], other=0.0)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK_G], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_G, HEAD_DIM], 0.0, dtype=tl.float32)
        kv_off_k = kv_head.to(tl.int64) * stride_kh
        kv_off_v = kv_head.to(tl.int64) * stride_vh
        own_lo = lo
        if HAS_PREFIX:
            # Keys below the row's shared prefix length come from the row that holds its prompt:
            # the rows of one prompt then read the same addresses, which the L2 cache can serve.
            prefix_row = tl.load(prefix_row_ptr + row64).to(tl.int64)
            prefix_hi = tl.minimum(hi, tl.load(prefix_len_ptr + row64).to(tl.int32))
            m_i, l_i, acc = _attend_range(q, k_ptr + prefix_row * stride_kb + kv_off_k,
                                          v_ptr + prefix_row * stride_vb + kv_off_v, lo, prefix_hi, m_i, l_i, acc,
                                          stride_kn, stride_kd, stride_vn, stride_vd, qk_scale_log2,
                                          BLOCK_N, HEAD_DIM, DOT_PRECISION, PIPELINED)
            own_lo = tl.maximum(lo, prefix_hi)
        m_i, l_i, acc = _attend_range(q, k_ptr + row64 * stride_kb + kv_off_k, v_ptr + row64 * stride_vb + kv_off_v,
                                      own_lo, hi, m_i, l_i, acc, stride_kn, stride_kd, stride_vn, stride_vd,
                                      qk_scale_log2, BLOCK_N, HEAD_DIM, DOT_PRECISION, PIPELINED)

        has_keys = l_i > 0.0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        if WRITE_FINAL:
            o_ptrs = out_ptr + row64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=group_mask[:, None])
        else:
            # Log-sum-exp in base 2 (the loop's units); -inf marks a split with no visible key.
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            slot = (row64 * num_heads + heads) * num_splits + split  # [B, H, splits] contiguous
            tl.store(part_lse_ptr + slot, lse, mask=group_mask)
            tl.store(part_out_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], out,
                     mask=group_mask[:, None])

    @triton.jit
    def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, stride_od,
                             num_heads, num_splits, HEAD_DIM: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs_d = tl.arange(0, HEAD_DIM)
        first = (row * num_heads + head) * num_splits
        # One split at a time, every value a scalar or a [D] vector in one layout: a [splits, D] tile
        # reduced over its splits goes through shared memory, where the threads that hold the same
        # element of the result all write it (compute-sanitizer's racecheck reports those writes).
        # Every row sees its own key, so some split's log-sum-exp is finite and so is the max.
        top = tl.load(part_lse_ptr + first)
        for split in range(1, num_splits):
            top = tl.maximum(top, tl.load(part_lse_ptr + first + split))
        acc = tl.full([HEAD_DIM], 0.0, tl.float32)
        total = tl.full([], 0.0, tl.float32)
        for split in range(0, num_splits):
            weight = tl.exp2(tl.load(part_lse_ptr + first + split) - top)  # 0 for a split with no key
            acc += weight * tl.load(part_out_ptr + (first + split) * HEAD_DIM + offs_d)
            total += weight
        tl.store(out_ptr + row * stride_ob + head * stride_oh + offs_d * stride_od,
                 (acc / total).to(out_ptr.dtype.element_ty))


def default_launch(head_dim: int) -> tuple[int, int, int]:
    """(keys per block, warps, pipeline stages) of the split kernel for `head_dim`."""
    block_n = 64 if head_dim <= 128 else 32  # keeps the K/V tiles of D=256 within registers
    return block_n, 4, 3


def _check_inputs(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                  position_ids: torch.Tensor, cache_len: int) -> None:
    batch, heads, steps, head_dim = q.shape
    rows, kv_heads, max_len, cache_dim = cache_k.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"decode_attention supports head dims {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if steps != 1:
        raise ValueError(f"decode_attention takes one query per row (q [B, H, 1, D]), got {tuple(q.shape)}")
    if cache_v.shape != cache_k.shape or cache_dim != head_dim:
        raise ValueError(f"cache shapes {tuple(cache_k.shape)}/{tuple(cache_v.shape)} "
                         f"do not match q's head dim {head_dim}")
    if heads % kv_heads != 0:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if rows < batch:
        raise ValueError(f"the cache has {rows} rows for a batch of {batch}")
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len {cache_len} outside (0, {max_len}]")
    if position_ids.shape != (batch, 1):
        raise ValueError(f"position_ids must be [B, 1] = [{batch}, 1], got {tuple(position_ids.shape)}")
    if not (q.dtype == cache_k.dtype == cache_v.dtype):
        raise ValueError(f"q, cache_k and cache_v must share a dtype, "
                         f"got {q.dtype}, {cache_k.dtype}, {cache_v.dtype}")


def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                     position_ids: torch.Tensor, cache_len: int, window: int | None = None,
                     scale: float | None = None, *, prefix_rows: torch.Tensor | None = None,
                     prefix_lens: torch.Tensor | None = None, num_splits: int | None = None,
                     launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Attention of one query per row over that row's cached keys, as flash-decoding.

    q [B, H, 1, D] (any strides); cache_k/cache_v [rows, H_kv, max_len, D] with rows >= B, batch
    row b reading cache row b; position_ids [B, 1]: row b sees keys j <= position_ids[b] (and
    j > position_ids[b] - window with a window); keys at >= cache_len are never read. Query head h
    uses kv head h // (H // H_kv). Returns [B, H, 1, D] in q's dtype; softmax statistics are
    float32. With `prefix_rows`/`prefix_lens` ([B] integers), row b reads its keys below
    `prefix_lens[b]` from cache row `prefix_rows[b]` instead of its own: the rows that share a
    prompt read one copy of it (the caller keeps those keys equal in every row; KVCache.share_prefix).
    `num_splits` overrides the split count (tests); by default about two programs per SM.
    `launch` = (keys per block, warps, pipeline stages) overrides `default_launch` (tuning sweeps).
    """
    if triton is None:
        raise RuntimeError("decode_attention needs triton; use decode_attention_reference without it")
    _check_inputs(q, cache_k, cache_v, position_ids, cache_len)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (a query sees at least its own key), got {window}")
    batch, heads, _, head_dim = q.shape
    kv_heads = cache_k.shape[1]
    group = heads // kv_heads
    block_n, num_warps, num_stages = launch or default_launch(head_dim)
    if num_splits is None:
        num_splits = choose_num_splits(batch * kv_heads, cache_len, block_n, _sm_count(q.device))
    blocks = -(-cache_len // block_n)
    num_splits = max(1, min(num_splits, blocks))
    keys_per_split = -(-blocks // num_splits) * block_n
    num_splits = -(-cache_len // keys_per_split)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    out = torch.empty(batch, heads, 1, head_dim, dtype=q.dtype, device=q.device)
    write_final = num_splits == 1  # one split: its normalised output is the answer, skip the merge
    if write_final:
        part_out, part_lse = out, out  # unused by the kernel in this mode
    else:
        part_out = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    has_prefix = prefix_rows is not None
    if has_prefix and (prefix_lens is None or prefix_rows.shape != (batch,) or prefix_lens.shape != (batch,)):
        raise ValueError(f"prefix_rows and prefix_lens must both be [B] = [{batch}]")
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, cache_k, cache_v, position_ids, prefix_rows if has_prefix else position_ids,
        prefix_lens if has_prefix else position_ids, part_out, part_lse, out,
        q.stride(0), q.stride(1), q.stride(3),
        *(cache_k.stride(i) for i in range(4)), *(cache_v.stride(i) for i in range(4)),
        position_ids.stride(0), out.stride(0), out.stride(1), out.stride(3),
        cache_len, keys_per_split, 0 if window is None else window, heads, num_splits,
        scale * LOG2_E,
        GROUP=group, BLOCK_G=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HEAD_DIM=head_dim, HAS_WINDOW=window is not None, HAS_PREFIX=has_prefix, WRITE_FINAL=write_final,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PIPELINED=q.is_cuda, num_warps=num_warps,
        num_stages=num_stages)
    if not write_final:
        _merge_splits_kernel[(batch, heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), out.stride(3), heads, num_splits,
            HEAD_DIM=head_dim, num_warps=1)
    return out
