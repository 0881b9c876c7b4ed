"""Grouped matrix products for mixture-of-experts layers: one product per projection for all experts.

Rows `x [n, K]` are sorted by expert; `offsets [E]` (int32, on the device) are the cumulative ends of
each expert's rows; `weight [E, N, K]` holds one `nn.Linear`-layout matrix per expert. Then
`grouped_linear(x, weight, offsets)[i] = x[i] @ weight[e(i)]ᵀ`, with e(i) the expert whose rows hold i.
Shapes are static whatever the routing (the output is always [n, N]) and the offsets never leave the
device, so a CUDA graph captures the product (MegaBlocks, Gale et al. 2023, runs MoE experts as
such block-sparse / grouped products instead of a loop over experts).

Three implementations, chosen per call:
- torch's native grouped GEMM (`F.grouped_mm`, `torch._grouped_mm` before torch 2.13): CUTLASS on
  CUDA for bfloat16 (sm90+), a reference kernel on the CPU. Its own backward is not used: the
  product is a custom op (torch.library) whose backward computes dX = grouped(dY, W) and
  dW_e = dY_eᵀ X_e (the 2-D × 2-D grouped form), each one grouped product again. As custom ops
  with their shapes declared, torch.compile calls them inside a compiled layer in any dtype.
- a padded batched product where the native one does not serve (float32 on CUDA, strides it refuses):
  rows scattered into [E, capacity, K], one `bmm`, gathered back. The capacity is the busiest
  expert's row count (one host sync), or all rows while a CUDA graph is being captured.
- on the sampling path (`triton_kernel_on`) at few rows an expert (a decode step; `THIN_ROWS_PER_EXPERT`),
  `thin_grouped_linear` (`thin_grouped_mm.py`): a Triton kernel with one program per (expert, block of output
  columns) that streams the expert's weights once for all its rows. A decode step reads nearly every expert's
  weights for a handful of rows each, so it is bound by that read, and the native kernel's tiles, cut for many
  rows an expert, leave part of the bandwidth unused (bench/grouped_gemm.py measures both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cohort_grpo.kernels.elementwise import triton_kernel_on
from cohort_grpo.kernels.thin_grouped_mm import THIN_ROWS_PER_EXPERT, thin_grouped_linear

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


# The native product as custom ops: torch.compile sees them as opaque calls with the shapes below, because the
# meta function torch registers for the grouped mm accepts bfloat16 alone and so cannot trace a float32 layer.
@torch.library.custom_op("cohort::grouped_linear", mutates_args=())
def native_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` by torch's grouped GEMM, with the grouped backward below."""
    return _native(x, weight.transpose(-2, -1), offs=offsets)


@native_grouped_linear.register_fake
def _(x, weight, offsets):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("cohort::grouped_linear_input_grad", mutates_args=())
def _input_grad(grad_out: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _native(grad_out, weight, offs=offsets)


@_input_grad.register_fake
def _(grad_out, weight, offsets):
    return grad_out.new_empty(grad_out.shape[0], weight.shape[2])


@torch.library.custom_op("cohort::grouped_linear_weight_grad", mutates_args=())
def _weight_grad(grad_out: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # dW_e = dY_eᵀ X_e for each expert's rows: the 2-D × 2-D grouped product gives [E, N, K]
    return _native(grad_out.t(), x, offs=offsets)


@_weight_grad.register_fake
def _(grad_out, x, offsets):
    return grad_out.new_empty(offsets.shape[0], grad_out.shape[1], x.shape[1])


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_out):
    x, weight, offsets = ctx.saved_tensors
    grad_out = grad_out.contiguous()  # a broadcast (stride-0) gradient is not a valid grouped operand
    grad_x = _input_grad(grad_out, weight, offsets) if ctx.needs_input_grad[0] else None
    grad_w = _weight_grad(grad_out, x, offsets) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


native_grouped_linear.register_autograd(_backward, setup_context=_save_inputs)


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


def decode_sized(x: torch.Tensor, rows: int, experts: int) -> bool:
    """Whether a grouped product of `rows` token copies over `experts` experts, of activations like `x`, is a
    decode step's: the sampling path (`triton_kernel_on`) at up to `THIN_ROWS_PER_EXPERT` copies an expert on
    average. Its products take the thin kernel, and its copies' order `expert_order.py` (moe.SparseMoeBlock)."""
    return rows <= THIN_ROWS_PER_EXPERT * experts and triton_kernel_on(x)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[n, N]: each row of `x` [n, K] times its expert's `weight` [E, N, K] transposed, rows grouped
    by expert with cumulative ends `offsets` [E] (int32)."""
    if decode_sized(x, x.shape[0], weight.shape[0]):
        return thin_grouped_linear(x, weight, offsets)
    if native_serves(x, weight):
        return native_grouped_linear(x, weight, offsets)
    return padded_grouped_linear(x, weight, offsets)
