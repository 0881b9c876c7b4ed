"""The grouped expert product of a decode step: few token copies an expert, every expert's weights read.

`thin_grouped_linear(x, weight, offsets)` is `grouped_mm.grouped_linear` (rows of `x` [n, K] sorted by
expert, `offsets` [E] their cumulative ends, `weight` [E, N, K]) as one Triton kernel for the sampling
path's forward: one program per (expert, block of BLOCK_N output columns) reads that block of the expert's
weights once for all the expert's rows, BLOCK_M rows at a time, and an expert without rows reads nothing.
The offsets stay on the device, so a CUDA graph captures it whatever the routing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cohort_grpo.kernels.triton_common import jit, tl, triton

# Most token copies an expert (on average) for which the sampling path takes `thin_grouped_linear`: measured on an
# H200 with 128 experts, it ran at 0.64-0.86x the native kernel's time at 32 and 0.98-1.16x at 64. A decode step
# of 512 sequences of Qwen3-30B-A3B (top-8 of 128) is 32; a prefill's many rows an expert, or Mixtral's 8 experts
# at a wide batch, go to the native kernel's large tiles (the thin kernel would read each weight once a BLOCK_M).
THIN_ROWS_PER_EXPERT = 32


@jit
def _thin_grouped_kernel(x_ptr, w_ptr, offsets_ptr, out_ptr, N, K, stride_xm, stride_we, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                         WIDEN: tl.constexpr):
    """Program (e, j): out[rows of e, j-th block of N] = x[rows of e] @ w[e, block]ᵀ, BLOCK_M rows at a time."""
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    end = tl.load(offsets_ptr + expert).to(tl.int64)
    start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    m = start
    while m < end:  # an expert with no rows reads none of its weights
        rows = m + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        for k in range(0, K, BLOCK_K):  # compiled, range() lets the next K block be prefetched
            ks = k + offs_k
            a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K),
                        other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks[None, :] < K), other=0.0)
            if WIDEN:  # the interpreter (CPU tests): its tl.dot would multiply bf16 storage as integers
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
        m += BLOCK_M


class ThinTile(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# bench/grouped_gemm.py's sweep on an H200 (Qwen3-30B-A3B's experts, whole and split two ways, 64-1,024 sequences):
# within 4% of the fastest tile at 64-128 sequences, the fastest at 256-1,024. SMALL_TILE (48 KiB of shared
# memory at most) serves a card that cannot launch TILE's 128 KiB.
TILE = ThinTile(block_n=128, block_k=64, num_warps=8, num_stages=4)
SMALL_TILE = ThinTile(block_n=64, block_k=64, num_warps=4, num_stages=2)
UNFIT_TILES: set[ThinTile] = set()
OUT_OF_RESOURCES = getattr(getattr(triton, "runtime", None), "OutOfResources", RuntimeError)


def rows_per_tile(rows: int, experts: int) -> int:
    """BLOCK_M: a power of two from 16 (tl.dot's least) to 128, at least twice the rows an expert has on average,
    so that nearly every expert's rows fit one tile and its weights are read once."""
    return max(16, min(128, triton.next_power_of_2(-(-2 * rows // experts))))


def thin_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, tile: ThinTile | None = None,
                        block_m: int | None = None) -> torch.Tensor:
    """`grouped_linear` by the Triton kernel above (no autograd: the sampling path's forward). `tile` and
    `block_m` override TILE and `rows_per_tile` (benchmarks). float32 is multiplied in full precision (not
    TF32), as `F.linear` does by default."""
    rows, experts = x.shape[0], weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = x.new_empty(rows, weight.shape[1])
    if rows == 0:
        return out
    tile = tile or (SMALL_TILE if TILE in UNFIT_TILES else TILE)
    block_m = block_m or rows_per_tile(rows, experts)
    try:
        launch(x, weight, offsets, out, tile, block_m)
    except OUT_OF_RESOURCES:  # raised on the host before anything is queued, so also safe in a graph capture
        if tile == SMALL_TILE:
            raise
        UNFIT_TILES.add(tile)
        launch(x, weight, offsets, out, SMALL_TILE, block_m)
    return out


def launch(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, tile: ThinTile,
           block_m: int) -> None:
    n, k = weight.shape[1], weight.shape[2]
    _thin_grouped_kernel[(weight.shape[0], triton.cdiv(n, tile.block_n))](
        x, weight, offsets, out, n, k, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", WIDEN=not x.is_cuda, num_warps=tile.num_warps,
        num_stages=tile.num_stages)
