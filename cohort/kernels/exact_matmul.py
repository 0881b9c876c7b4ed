"""A batch-invariant matrix product: y = x Wᵀ (+ b) whose every row is the same bits whatever the
other rows (Thinking Machines Lab, He et al. 2025, "Defeating Nondeterminism in LLM Inference").

cuBLAS picks its kernel, tile shape and split of the reduction axis K by the shape of the problem,
so the engine's decode GEMM over 64 rows and the trainer's GEMM over 12,000 rows sum each dot
product in a different order, and round differently. Here one kernel configuration serves every
call (`TILE`): each program owns a fixed BLOCK_M × BLOCK_N tile of the output and walks K from 0
to the end in steps of BLOCK_K, accumulating in float32; the K axis is never split. An output
element is then a function of its row of x and its column of W alone: not of the number of rows,
of the row's place in its tile, nor of the other columns (so q/k/v read as one fused matrix give
the bits of three separate products). The bias is added to the float32 sum before the one rounding
to the output dtype.

`linear` is the autograd entry (`ExactLinear`): its forward is the kernel, its backward torch's
matmuls (the gradient's values need not be bit-exact; the forward that computes π_θ must equal the
one that computed π_old, which it does). `matmul_reference` is the float64 definition the tests
compare with.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .triton_common import tl, triton  # noqa: F401  (triton None: not installed; `linear` then refuses)
from .triton_common import jit as _jit


class Tile(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The one configuration. Changing it changes the bits of every exact product, on both sides at once,
# never the agreement between them; a tuning sweep may set another (the same for every call).
TILE = Tile(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


@_jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                   stride_om, stride_on, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PIPELINED: tl.constexpr):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    col_ok = offs_n < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)  # (tl.zeros: a jit helper the interpreter may not call)
    if PIPELINED:  # range() lets the compiler prefetch the next K block
        for start in range(0, K, BLOCK_K):
            ks = start + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                        mask=col_ok[None, :] & (ks[:, None] < K), other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    else:  # the interpreter (CPU tests): the same blocks in the same order
        start = 0
        while start < K:
            ks = start + offs_k
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                        mask=col_ok[None, :] & (ks[:, None] < K), other=0.0)
            # The interpreter's tl.dot would multiply bf16 storage as integers: widen first (a bf16
            # product is exact in float32, so this is the product the GPU's tensor cores form).
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=PRECISION)
            start += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tile: Tile | None = None
           ) -> torch.Tensor:
    """x [..., K] @ weight [N, K]ᵀ (+ bias [N]) in x's dtype, float32 accumulation, by the one kernel
    configuration (`TILE`, or `tile`): each output row's bits depend on that row of x alone."""
    if triton is None:
        raise RuntimeError("the batch-invariant matmul needs triton")
    if weight.dtype != x.dtype:
        raise ValueError(f"exact matmul: x is {x.dtype}, the weight {weight.dtype}; they must match")
    tile = tile or TILE
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n))
        _matmul_kernel[grid](
            x2, weight, bias if bias is not None else weight, out, m, n, k, x2.stride(0), x2.stride(1),
            weight.stride(0), weight.stride(1), out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PIPELINED=x.is_cuda,
            num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out.reshape(*lead, n)


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
