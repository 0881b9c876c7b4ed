"""Grouped matrix products for mixture-of-experts layers: one product per projection for all experts.

Rows `x [n, K]` are sorted by expert; `offsets [E]` (int32, on the device) are the cumulative ends of
each expert's rows; `weight [E, N, K]` holds one `nn.Linear`-layout matrix per expert. Then
`grouped_linear(x, weight, offsets)[i] = x[i] @ weight[e(i)]ᵀ`, with e(i) the expert whose rows hold i.
Shapes are static whatever the routing (the output is always [n, N]) and the offsets never leave the
device, so a CUDA graph captures the product (MegaBlocks, Gale et al. 2023, runs MoE experts as
such block-sparse / grouped products instead of a loop over experts).

Two implementations, chosen per call:
- torch's native grouped GEMM (`F.grouped_mm`, `torch._grouped_mm` before torch 2.13): CUTLASS on
  CUDA for bfloat16 (sm90+), a reference kernel on the CPU. Its own backward is not used: a custom
  autograd function computes dX = grouped(dY, W) and dW_e = dY_eᵀ X_e (the 2-D × 2-D grouped form),
  each one grouped product again.
- a padded batched product where the native one does not serve (float32 on CUDA, strides it refuses):
  rows scattered into [E, capacity, K], one `bmm`, gathered back. The capacity is the busiest
  expert's row count (one host sync), or all rows while a CUDA graph is being captured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_native = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def native_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs this product: CPU, or CUDA in bfloat16 on sm90+; row strides
    a multiple of 16 bytes (the kernels' alignment rule)."""
    if _native is None or x.dtype != weight.dtype:
        return False
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
            return False
    elif x.device.type != "cpu":
        return False
    aligned = 16 // x.element_size()
    return weight.shape[-1] % aligned == 0 and weight.shape[-2] % aligned == 0


def _native_product(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _native(x, weight.transpose(-2, -1), offs=offsets)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets):
        ctx.save_for_backward(x, weight, offsets)
        return _native_product(x, weight, offsets)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()  # a broadcast (stride-0) gradient is not a valid grouped operand
        grad_x = _native(grad_out, weight, offs=offsets) if ctx.needs_input_grad[0] else None
        # dW_e = dY_eᵀ X_e for each expert's rows: the 2-D × 2-D grouped product gives [E, N, K]
        grad_w = _native(grad_out.t(), x, offs=offsets) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def padded_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` as one `bmm` over rows padded to [E, capacity, K] (autograd through plain ops)."""
    experts, rows = weight.shape[0], x.shape[0]
    offsets = offsets.long()
    starts = torch.cat([offsets.new_zeros(1), offsets[:-1]])
    row = torch.arange(rows, device=x.device)
    expert = torch.searchsorted(offsets, row, right=True).clamp(max=experts - 1)
    slot = row - starts[expert]
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    capacity = rows if capturing or rows == 0 else int((offsets - starts).max().item())
    padded = x.new_zeros(experts, max(capacity, 1), x.shape[1]).index_put((expert, slot), x)
    out = torch.bmm(padded, weight.transpose(-2, -1))
    return out[expert, slot]


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[n, N]: each row of `x` [n, K] times its expert's `weight` [E, N, K] transposed, rows grouped
    by expert with cumulative ends `offsets` [E] (int32)."""
    if native_serves(x, weight):
        return _GroupedLinear.apply(x, weight, offsets)
    return padded_grouped_linear(x, weight, offsets)
