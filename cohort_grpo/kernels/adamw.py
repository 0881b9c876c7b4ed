"""One AdamW step of a bf16 parameter with an fp32 master and bf16 moments, in one pass over memory.

`MasterWeightAdamW` (cohort_grpo/optim/precision.py) keeps, per parameter, the bf16 weight, the 16 low
bits its fp32 master lacks, and AdamW's two moments in bf16. In torch its step takes several passes
per chunk: widen the gradient, rebuild the master, widen both moments, torch's fused AdamW, split
the master again, round each moment stochastically. This kernel reads each of those five 2-byte
arrays once and writes four of them once (18 bytes a parameter), doing the same arithmetic in fp32
registers:

    master ← join(weight, low)                         exactly the fp32 master
    master ← master · (1 − lr · weight_decay)          decoupled weight decay (Loshchilov & Hutter 2019)
    m ← m + (1 − β1)(g − m),  v ← β2 v + (1 − β2) g²   g = clip · grad
    master ← master − lr / (1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε)
    weight, low ← split(master);  m, v ← bf16, rounded stochastically

torch's fused AdamW computes the same expressions. The stochastic rounding's noise is a hash of
(seed, element), where the caller makes the seed from the run's seed, the step and the tensor: it
depends on nothing else, so a rerun and a resumed run draw the same.
"""

from __future__ import annotations

import math

import torch

from cohort_grpo.kernels.triton_common import jit, tl, triton

BLOCK = 1024


@jit
def _adamw_bf16_kernel(weight_ptr, low_ptr, grad_ptr, m_ptr, v_ptr, clip_ptr, n, start, seed, decay_factor, beta2,
                       one_minus_beta1, one_minus_beta2, eps, step_size, bias_correction2_sqrt, HAS_CLIP: tl.constexpr,
                       BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    high = tl.load(weight_ptr + offsets, mask=inside, other=0).to(tl.int32)  # int16 patterns, sign-extended
    low = tl.load(low_ptr + offsets, mask=inside, other=0).to(tl.int32)
    master = (high * 65536 + low).to(tl.float32, bitcast=True)
    grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_CLIP:
        grad = grad * tl.load(clip_ptr)
    m = (tl.load(m_ptr + offsets, mask=inside, other=0).to(tl.int32) * 65536).to(tl.float32, bitcast=True)
    v = (tl.load(v_ptr + offsets, mask=inside, other=0).to(tl.int32) * 65536).to(tl.float32, bitcast=True)

    master = master * decay_factor
    # 1 − β from the host in double: 1 − 0.999 in fp32 registers is 1.3e-5 off, relative.
    m = m + one_minus_beta1 * (grad - m)
    v = v * beta2 + one_minus_beta2 * grad * grad
    # IEEE square root and division, as torch's kernel (a GPU's fast ones are off by up to 2 units).
    denominator = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    master = master - tl.div_rn(step_size * m, denominator)

    # The split of bf16.split_master (cohort_grpo/memory): round to nearest even (in integers, as torch's cast rounds, not
    # as a backend's conversion might), and a tie stored rounded away from zero.
    bits = master.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    difference = bits - rounded * 65536
    tie = difference == 32768
    rounded = rounded + tie.to(tl.int32)
    difference = tl.where(tie, -32768, difference)
    tl.store(weight_ptr + offsets, rounded.to(tl.int16), mask=inside)
    tl.store(low_ptr + offsets, difference.to(tl.int16), mask=inside)

    # Stochastic rounding of both moments: a uniform 16-bit integer added to the fp32 pattern, the low
    # half dropped. The top half of an int32 is its arithmetic shift by 16, for either sign.
    # 32 random bits per element: Wellons' lowbias32 mixer (as cohort's sampler) over (seed, index), in
    # uint32 so shifts are logical and products wrap.
    key = tl.full([], 0, tl.uint32) + seed  # a tensor also when triton passed the seed as a constant
    index = (offsets + start).to(tl.uint32)  # the element's place in its whole tensor: a slice draws its own noise
    noise = index * tl.full([], 0x9E3779B9, tl.uint32) ^ key
    noise = noise ^ (noise >> 16)
    noise = noise * tl.full([], 0x7FEB352D, tl.uint32)
    noise = noise ^ (noise >> 15)
    noise = noise * tl.full([], 0x846CA68B, tl.uint32)
    noise = noise ^ (noise >> 16)
    m_bits = (m.to(tl.int32, bitcast=True) + (noise & 0xFFFF).to(tl.int32)) >> 16
    v_bits = (v.to(tl.int32, bitcast=True) + ((noise >> 16) & 0xFFFF).to(tl.int32)) >> 16
    m_bits = tl.where(m != m, 0x7FC0, m_bits)  # a NaN stays NaN: its pattern plus noise could wrap
    v_bits = tl.where(v != v, 0x7FC0, v_bits)
    tl.store(m_ptr + offsets, m_bits.to(tl.int16), mask=inside)
    tl.store(v_ptr + offsets, v_bits.to(tl.int16), mask=inside)


def fused_adamw_available(tensor: torch.Tensor) -> bool:
    """Whether the kernel can step `tensor` compiled: triton installed and the tensor on a GPU."""
    return triton is not None and tensor.is_cuda


def adamw_bf16_step(weight: torch.Tensor, low: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, seed: int, clip: torch.Tensor | None = None, start: int = 0) -> None:
    """Step one parameter in place: `weight` (bf16) and `low` (int16) hold its fp32 master, `exp_avg` and
    `exp_avg_sq` (bf16) its moments, `grad` (bf16) its gradient, `clip` (a 0-d fp32 tensor) the factor
    clipping scales it by, `step` the step count after this step (≥ 1), `seed` the noise's key. `start`: where
    these tensors begin in the flattened parameter when they are a slice of it, so that stepping a parameter
    slice by slice draws the same noise, and gives the same bits, as stepping it whole."""
    n = weight.numel()
    if n == 0:
        return
    tensors = (weight, low, grad, exp_avg, exp_avg_sq)
    if not all(t.is_contiguous() and t.numel() == n for t in tensors):
        raise ValueError("adamw_bf16_step needs contiguous tensors of one size")
    grid = (triton.cdiv(n, BLOCK),)
    _adamw_bf16_kernel[grid](
        weight.view(torch.int16), low, grad, exp_avg.view(torch.int16), exp_avg_sq.view(torch.int16),
        clip if clip is not None else grad, n, start, seed, 1.0 - lr * weight_decay, beta2, 1.0 - beta1, 1.0 - beta2, eps,
        lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step), HAS_CLIP=clip is not None, BLOCK=BLOCK)
