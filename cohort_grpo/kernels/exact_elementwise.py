"""The rotary embedding and the SwiGLU gate under rollout_numerics="exact", one Triton kernel each.

Elementwise arithmetic has no reduction order to fix, but as plain torch ops each piece is several
kernels (rotary: two products, a negation, a concatenation, a sum; then the cache write's index_put),
and in a decode step of a small model those launches cost as much as the matrix products. Here each is
one kernel, run by the engine's decode step and by the trainer's forward alike, so the two sides compute
the same function. Each computes in float32 and rounds once to the tensors' dtype (x·cos + rot(x)·sin;
silu(gate)·up): the plain functions (`elementwise.rotate_plain`, `swiglu_gate_plain`) round every
product too, so in bf16 the two differ by an ulp here and there (equal in float32, up to exp's rounding);
what matters is that the sampler and the trainer run the same one.

The decode step writes the rotated keys, and the values, straight into the KV cache at each row's
position (`positions`), as `KVCache.write` would.

`rotate` and `swiglu_gate` are differentiable: the backward recomputes the plain torch function.
`gated_activation_kernel` (SiLU or GELU-tanh of the gate, times up) also serves the generic path's sampling
forwards (cohort_grpo/models/generic_fusion.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from cohort_grpo.kernels.elementwise import swiglu_gate_plain
from cohort_grpo.kernels.triton_common import tl, triton  # noqa: F401
from cohort_grpo.kernels.triton_common import jit as _jit

BLOCK_T = 16  # tokens per program


@_jit
def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, pos_ptr, length, stride_xb, stride_xh, stride_xt,
                   stride_cb, stride_ct, stride_ob, stride_oh, stride_ot, stride_pb, stride_pt,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, ROTATE: tl.constexpr, AT_POSITIONS: tl.constexpr,
                   BLOCK_T: tl.constexpr):
    """x [B, H, T, D] rotated (ROTATE) or copied to out [B, H, ·, D] at token t's index t, or positions[b, t]."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_HALF)
    ok = (offs_t < length)[:, None] & (offs_d < HALF)[None, :]
    x_at = x_ptr + row * stride_xb + head * stride_xh + offs_t[:, None] * stride_xt + offs_d[None, :]
    first = tl.load(x_at, mask=ok, other=0.0)
    second = tl.load(x_at + HALF, mask=ok, other=0.0)
    if AT_POSITIONS:
        slot = tl.load(pos_ptr + row * stride_pb + offs_t * stride_pt, mask=offs_t < length, other=0).to(tl.int64)
    else:
        slot = offs_t.to(tl.int64)
    out_at = out_ptr + row * stride_ob + head * stride_oh + slot[:, None] * stride_ot + offs_d[None, :]
    if ROTATE:
        dtype = x_ptr.dtype.element_ty
        trig = row * stride_cb + offs_t[:, None] * stride_ct + offs_d[None, :]
        cos1 = tl.load(cos_ptr + trig, mask=ok, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + trig + HALF, mask=ok, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + trig, mask=ok, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + trig + HALF, mask=ok, other=0.0).to(tl.float32)
        a, b = first.to(tl.float32), second.to(tl.float32)
        out1 = (a * cos1 - b * sin1).to(dtype)  # x·cos + cat(−x₂, x₁)·sin in float32, rounded once
        out2 = (b * cos2 + a * sin2).to(dtype)
        tl.store(out_at, out1.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_at + HALF, out2.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_at, first.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_at + HALF, second.to(out_ptr.dtype.element_ty), mask=ok)


@_jit
def _gated_activation_kernel(gate_ptr, up_ptr, out_ptr, rows, cols, stride_g, stride_u, stride_o,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, GELU_TANH: tl.constexpr):
    """act(gate) * up in float32, rounded once: act SiLU, or GELU's tanh approximation (GELU_TANH)."""
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    dtype = gate_ptr.dtype.element_ty
    g = tl.load(gate_ptr + offs_r[:, None] * stride_g + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offs_r[:, None] * stride_u + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))), tanh(z) = 1 − 2 / (e^{2z} + 1) (finite at both ends)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        activated = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:
        activated = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + offs_r[:, None] * stride_o + offs_c[None, :], (activated * u).to(dtype), mask=ok)


def rotate_kernel(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, out: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, H, T, D] (unit stride along D) rotated by cos/sin [B, T, D] (None: copied unrotated) into `out`
    [B', H, S, D] (default: a new [B, H, T, D]) at token t's index t, or at `positions` [B, T] (a cache row)."""
    if triton is None:
        raise RuntimeError("the exact rotary kernel needs triton")
    batch, heads, length, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(batch, heads, length, dim, dtype=x.dtype, device=x.device)
    if not (batch and length):
        return out
    rotate_it = cos is not None
    if rotate_it:
        cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    trig = cos if rotate_it else x
    pos = positions if positions is not None else x
    half = dim // 2
    _rotate_kernel[(batch, heads, triton.cdiv(length, BLOCK_T))](
        x, trig, sin if rotate_it else x, out, pos, length, x.stride(0), x.stride(1), x.stride(2),
        trig.stride(0) if rotate_it else 0, trig.stride(1) if rotate_it else 0, out.stride(0), out.stride(1),
        out.stride(2), pos.stride(0) if positions is not None else 0, pos.stride(1) if positions is not None else 0,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), ROTATE=rotate_it, AT_POSITIONS=positions is not None,
        BLOCK_T=BLOCK_T, num_warps=2)
    return out


def swiglu_kernel(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate/up [..., I] (rows of any stride, unit stride along I)."""
    return gated_activation_kernel(gate, up, "silu")


GATED_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def gated_activation_kernel(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate/up [..., I] (rows of any stride, unit stride along I), act one of
    `GATED_ACTIVATIONS` (the torch function the kernel computes, up to float32 rounding)."""
    if triton is None:
        raise RuntimeError("the gated activation kernel needs triton")
    cols = gate.shape[-1]
    g2, u2 = gate.reshape(-1, cols), up.reshape(-1, cols)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if g2.shape[0] and cols:
        block_r, block_c = 16, 128
        _gated_activation_kernel[(triton.cdiv(g2.shape[0], block_r), triton.cdiv(cols, block_c))](
            g2, u2, out, g2.shape[0], cols, g2.stride(0), u2.stride(0), out.stride(0), BLOCK_R=block_r,
            BLOCK_C=block_c, GELU_TANH=activation == "gelu_tanh", num_warps=4)
    return out.reshape(gate.shape)


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate_kernel(x, cos, sin)

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        # x·cos + rot(x)·sin is linear in x; its transpose: g·cos + rotᵀ(g·sin), rotᵀ(y) = cat(y₂, −y₁)
        half = grad_out.shape[-1] // 2
        scaled = grad_out * sin[:, None]
        return grad_out * cos[:, None] + torch.cat((scaled[..., half:], -scaled[..., :half]), dim=-1), None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_kernel(gate, up)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [gate.detach().requires_grad_(), up.detach().requires_grad_()]
            grads = torch.autograd.grad(swiglu_gate_plain(*leaves), leaves, grad_out)
        return grads


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotate_plain`'s rotation of x [B, H, T, D] by the kernel (differentiable)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rotate.apply(x, cos, sin)
    return rotate_kernel(x, cos, sin)


def swiglu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up by the kernel (differentiable)."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLU.apply(gate, up)
    return swiglu_kernel(gate, up)
