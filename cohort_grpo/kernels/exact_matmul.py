"""A batch-invariant matrix product: y = x Wᵀ (+ b) whose every row is the same bits whatever the
other rows (Thinking Machines Lab, He et al. 2025, "Defeating Nondeterminism in LLM Inference").

cuBLAS picks its kernel, tile shape and split of the reduction axis K by the shape of the problem,
so the engine's decode GEMM over 64 rows and the trainer's GEMM over 12,000 rows sum each dot
product in a different order, and round differently. Here the order of the sum is fixed by K alone:
K is cut into chunks of CHUNK_K columns; each chunk is summed from zero in BLOCK_K steps in float32
(tensor-core products in order), and the chunks' sums are added in order from 0.0. An output element
is then a function of its row of x and its column of W alone: not of the number of rows, of the row's
place in its tile, nor of the other columns (so q/k/v read as one fused matrix give the bits of three
separate products). The bias is added to the float32 sum before the one rounding to the output dtype.

How the work is cut is free within that order: the tile (BLOCK_M × BLOCK_N, warps, pipeline stages)
is chosen by the number of rows (`TILES`), and a thin product with many chunks (a decode step's down
projection) runs one program per chunk, writing float32 partial sums that a second kernel adds in the
same order. On an H200 all 17 tiles measured (tensor-core instructions of both generations) give the
same bits as one another, whole or split (bench/exact_tiles.py).

`linear` is the autograd entry (`ExactLinear`): its forward is the kernel, its backward torch's
matmuls (the gradient's values need not be bit-exact; the forward that computes π_θ must equal the
one that computed π_old, which it does). `matmul_reference` is the float64 definition the tests
compare with.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cohort_grpo.kernels.triton_common import tl, triton  # noqa: F401  (triton None: not installed; `linear` then refuses)
from cohort_grpo.kernels.triton_common import jit as _jit


class Tile(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The reduction axis K is summed in chunks of CHUNK_K columns: each chunk in BLOCK_K steps from zero, then
# the chunks' float32 sums added in order from 0.0. That order is a function of K alone. A program may walk
# all the chunks itself, or (few rows, a thin output: too few tiles to fill the GPU) each chunk may be its
# own program that writes its float32 sum, added in the same order by `_chunk_sums_kernel`: the same bits.
CHUNK_K = 1024

# The tile of the CPU interpreter (tests), of a GPU that cannot launch a tile of `TILES`, and the one the
# GPU test compares `TILES` with.
TILE = Tile(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


@_jit
def _chunk_product(x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, start, end, stride_xm, stride_xk, stride_wn,
                   stride_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, PIPELINED: tl.constexpr):
    """x[rows, start:end] @ w[cols, start:end]ᵀ in float32, from zero, BLOCK_K columns at a time in order."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)  # (tl.zeros: a jit helper the interpreter may not call)
    if PIPELINED:  # range() lets the compiler prefetch the next K block
        for k in range(start, end, BLOCK_K):
            ks = k + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=row_ok[:, None] & (ks[None, :] < end), other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                        mask=col_ok[None, :] & (ks[:, None] < end), other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    else:  # the interpreter (CPU tests): the same blocks in the same order
        k = start
        while k < end:
            ks = k + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=row_ok[:, None] & (ks[None, :] < end), other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                        mask=col_ok[None, :] & (ks[:, None] < end), other=0.0)
            # The interpreter's tl.dot would multiply bf16 storage as integers: widen first (a bf16
            # product is exact in float32, so this is the product the GPU's tensor cores form).
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=PRECISION)
            k += BLOCK_K
    return acc


@_jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                   stride_om, stride_on, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_K: tl.constexpr, PRECISION: tl.constexpr,
                   PIPELINED: tl.constexpr):
    """SPLIT: program (m, n, c) writes chunk c's float32 sum to out [chunks, M, N]; else each program adds its
    tile's chunks in order, adds the bias and rounds once to the output dtype."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    col_ok = offs_n < N
    if SPLIT:
        chunk = tl.program_id(2).to(tl.int64)
        start = chunk * CHUNK_K
        part = _chunk_product(x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, start, tl.minimum(start + CHUNK_K, K),
                              stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
                              PIPELINED)
        tl.store(out_ptr + chunk * M * N + offs_m[:, None] * N + offs_n[None, :], part,
                 mask=row_ok[:, None] & col_ok[None, :])
    else:
        total = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        if PIPELINED:
            for start in range(0, K, CHUNK_K):
                total += _chunk_product(x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, start,
                                        tl.minimum(start + CHUNK_K, K), stride_xm, stride_xk, stride_wn, stride_wk,
                                        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, PIPELINED)
        else:
            start = 0
            while start < K:
                total += _chunk_product(x_ptr, w_ptr, offs_m, offs_n, row_ok, col_ok, start,
                                        tl.minimum(start + CHUNK_K, K), stride_xm, stride_xk, stride_wn, stride_wk,
                                        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, PIPELINED)
                start += CHUNK_K
        if HAS_BIAS:
            total += tl.load(b_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                 total.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@_jit
def _chunk_sums_kernel(part_ptr, b_ptr, out_ptr, M, N, CHUNKS, stride_om, stride_on, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = (0 + chunk 0 + chunk 1 + ...) + bias, in that order, rounded once: a split product's last step."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    total = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    chunk = 0
    while chunk < CHUNKS:
        total += tl.load(part_ptr + chunk * M * N + offs_m[:, None] * N + offs_n[None, :], mask=ok, other=0.0)
        chunk += 1
    if HAS_BIAS:
        total += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             total.to(out_ptr.dtype.element_ty), mask=ok)


class Plan(NamedTuple):
    tile: Tile
    split: bool  # one program per (tile, chunk) and a second kernel that adds the chunks


# Tiles by the number of rows (the first entry whose bound is >= M), the fastest that bench/exact_tiles.py
# found for each width (docs/history/2026-11-29-exact-numerics-h200.md). Only the order of the K sum fixes
# the bits, so every tile gives the same bits, whole or split, and a tile is a matter of speed only;
# tests/test_exact_numerics_gpu.py holds these to it on the GPU at hand.
TILES: tuple[tuple[int, Tile], ...] = (
    (256, Tile(64, 64, 128, 4, 3)),  # decode steps
    (8192, Tile(128, 128, 64, 8, 4)),
    (2**62, Tile(128, 256, 64, 8, 3)),  # the trainer's micro-batches
)
# Split a product into its chunks when it has at least SPLIT_MIN_CHUNKS of them and fewer tiles than
# SPLIT_BELOW_TILES: a thin product has too few tiles to fill the GPU (a decode step's down projection of
# Qwen2.5-0.5B/1.5B: 14-24 tiles, an H100 or H200 has 132 SMs), and a program per chunk fills it; with fewer
# chunks or more tiles the split measured slower (the history page above).
SPLIT_MIN_CHUNKS = 4
SPLIT_BELOW_TILES = 64
UNFIT_TILES: set[Tile] = set()  # tiles this GPU could not launch (shared memory): `TILE` serves instead, same bits
OUT_OF_RESOURCES = getattr(getattr(triton, "runtime", None), "OutOfResources", RuntimeError)


def plan(m: int, n: int, k: int, device: torch.device) -> Plan:
    """How to compute an [m, k] @ [n, k]ᵀ product: the tile and whether to split it by chunk (speed only)."""
    if device.type != "cuda":
        return Plan(TILE, False)
    tile = next(t for bound, t in TILES if m <= bound)
    tile = TILE if tile in UNFIT_TILES else tile
    tiles = triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n)
    return Plan(tile, triton.cdiv(k, CHUNK_K) >= SPLIT_MIN_CHUNKS and tiles < SPLIT_BELOW_TILES)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile: Tile | None = None,
           split: bool | None = None, chunk_k: int = CHUNK_K) -> torch.Tensor:
    """x [..., K] @ weight [N, K]ᵀ (+ bias [N]) in x's dtype, float32 accumulation in `chunk_k` chunks: each output
    row's bits depend on that row of x alone. `tile` and `split` override `plan`'s choice (tests, benchmarks);
    a `chunk_k` other than CHUNK_K changes the bits (tests)."""
    if triton is None:
        raise RuntimeError("the batch-invariant matmul needs triton")
    if weight.dtype != x.dtype:
        raise ValueError(f"exact matmul: x is {x.dtype}, the weight {weight.dtype}; they must match")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    chosen = plan(m, n, k, x.device)
    tile = tile or chosen.tile
    split = chosen.split if split is None else split
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not (m and n):
        return out.reshape(*lead, n)
    try:
        launch(x2, weight, bias, out, tile, split, chunk_k)
    except OUT_OF_RESOURCES:  # a card with less shared memory than the one TILES was measured on
        if tile == TILE:
            raise
        UNFIT_TILES.add(tile)
        launch(x2, weight, bias, out, TILE, split, chunk_k)
    return out.reshape(*lead, n)


def launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, tile: Tile,
            split: bool, chunk_k: int) -> None:
    """out [M, N] = x2 [M, K] @ weight [N, K]ᵀ (+ bias) by `tile`, split by chunk or whole (`matmul`'s kernels)."""
    (m, k), n = x2.shape, weight.shape[0]
    chunks = max(1, triton.cdiv(k, chunk_k))
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n))
    common = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, CHUNK_K=chunk_k,
                  PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", PIPELINED=x2.is_cuda,
                  num_warps=tile.num_warps, num_stages=tile.num_stages)
    if split and chunks > 1:
        parts = torch.empty(chunks, m, n, dtype=torch.float32, device=x2.device)
        _matmul_kernel[(*grid, chunks)](x2, weight, weight, parts, m, n, k, x2.stride(0), x2.stride(1),
                                        weight.stride(0), weight.stride(1), n, 1, HAS_BIAS=False, SPLIT=True, **common)
        _chunk_sums_kernel[grid](parts, bias if bias is not None else weight, out, m, n, chunks, out.stride(0),
                                 out.stride(1), HAS_BIAS=bias is not None, BLOCK_M=tile.block_m,
                                 BLOCK_N=tile.block_n, num_warps=4)
    else:
        _matmul_kernel[grid](x2, weight, bias if bias is not None else weight, out, m, n, k, x2.stride(0), x2.stride(1),
                             weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
                             HAS_BIAS=bias is not None, SPLIT=False, **common)


def matmul_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product in float64, rounded once to x's dtype (what the kernel approximates)."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)


class ExactLinear(torch.autograd.Function):
    """F.linear with the batch-invariant kernel forward and torch's matmuls backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return matmul(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_weight, grad_bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), forward by the batch-invariant kernel (differentiable)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return ExactLinear.apply(x, weight, bias)
    return matmul(x, weight, bias)
