"""RMSNorm (Zhang & Sennrich 2019) with one reduction tree for every row, whatever the batch.

torch's `x.pow(2).mean(-1)` picks its reduction strategy by the number of rows: few rows get
several threads or blocks per row, many rows one warp each, so a token's mean square is summed in a
different order in a decode step than in a training forward (the batch-invariance problem of
Thinking Machines Lab, He et al. 2025, "Defeating Nondeterminism in LLM Inference"). Here one
program normalises one row with a fixed block and warp count, so the bits of a row depend on that
row only. The rounding points are those of `elementwise.rms_norm_plain` (and of transformers'
LlamaRMSNorm): x·rsqrt(mean(x²) + eps) in float32, rounded to x's dtype, times the weight in its
dtype's arithmetic.

The kernel also computes the other rounding points transformers' norms use (1 + weight as Gemma's,
the product in float32 as OLMo 2's and Gemma's: `rms_norm_variant_plain`), for the generic path's
sampling forwards (cohort_grpo/models/generic_fusion.py).

`rms_norm` is the autograd entry: the kernel forward, the backward by recomputing the plain
definition in torch (its gradient's values need not be bit-exact).
"""

from __future__ import annotations

import torch

from cohort_grpo.kernels.elementwise import rms_norm_plain
from cohort_grpo.kernels.triton_common import SUM_COMBINE, tl, triton  # noqa: F401
from cohort_grpo.kernels.triton_common import jit as _jit

NUM_WARPS = 4  # fixed: the reduction tree is a function of the block and the warps


@_jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, dim, stride_x, stride_out, eps, BLOCK: tl.constexpr,
                     ONE_PLUS_WEIGHT: tl.constexpr, ROUND_NORMED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    mean_square = tl.reduce(x * x, 0, SUM_COMBINE) / dim
    normed = x * (1.0 / tl.sqrt(mean_square + eps))
    if ROUND_NORMED:  # rounded to x's dtype before the weight's product (Llama's rounding points)
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if ONE_PLUS_WEIGHT:  # Gemma's scale, 1 + weight in float32
        w = 1.0 + w
    # weight * normed in float32 rounded once to the output dtype: with ROUND_NORMED a product of two bf16 values
    out = (w * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + offs, out, mask=ok)


def rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus_weight: bool = False,
                    round_normed: bool = True) -> torch.Tensor:
    """The forward: rows of x [..., D] normalised one program each; weight [D]. The defaults compute
    `rms_norm_plain`; `one_plus_weight` scales by 1 + weight, and without `round_normed` the normalised
    row stays float32 into the weight's product and the result is in x's dtype (Gemma's and OLMo 2's
    norms: `rms_norm_variant_plain`)."""
    if triton is None:
        raise RuntimeError("the batch-invariant RMSNorm needs triton")
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if round_normed else x.dtype
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, dim, x2.stride(0), out.stride(0), float(eps),
                                         BLOCK=triton.next_power_of_2(dim), ONE_PLUS_WEIGHT=one_plus_weight,
                                         ROUND_NORMED=round_normed, num_warps=NUM_WARPS)
    return out.reshape(x.shape)


def rms_norm_variant_plain(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus_weight: bool = False,
                           round_normed: bool = True) -> torch.Tensor:
    """`rms_norm_kernel`'s value in torch ops (its reference, and its stand-in where triton cannot run)."""
    if round_normed and not one_plus_weight:
        return rms_norm_plain(x, weight, eps)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if round_normed:
        normed = normed.to(x.dtype).float()
    scale = 1.0 + weight.float() if one_plus_weight else weight.float()
    return (scale * normed).to(torch.promote_types(x.dtype, weight.dtype) if round_normed else x.dtype)


class ExactRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_kernel(x, weight, eps)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_leaf, w_leaf = x.detach().requires_grad_(), weight.detach().requires_grad_()
            out = rms_norm_plain(x_leaf, w_leaf, ctx.eps)
            grad_x, grad_w = torch.autograd.grad(out, (x_leaf, w_leaf), grad_out)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`elementwise.rms_norm_plain`'s value, row by row in one fixed order (differentiable)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return ExactRMSNorm.apply(x, weight, eps)
    return rms_norm_kernel(x, weight, eps)
