"""A bf16 number is the top half of an fp32 one: the bit-level operations cohort's optimizer builds on.

- `split_master` / `join_master`: an fp32 master stored exactly as its bf16 rounding and the 16 low
  bits that rounding drops (2 bytes a parameter beside the bf16 weight instead of a 4-byte copy);
- `round_stochastic`: fp32 to bf16, rounded up or down at random so that the result is right on
  average (AdamW's moments in bf16, cohort_grpo/optim/precision.py);
- `element_noise` / `round_with_noise`: the same rounding with noise that is a hash of (key, element
  index), the GPU kernel's, so that a slice of a tensor (an FSDP2 shard, cohort_grpo/optim/sharded_adamw.py)
  draws exactly the noise its elements draw in the whole tensor.

The GPU's one-pass AdamW step (cohort_grpo/kernels/adamw.py) does the same in registers.
"""

from __future__ import annotations

import sys

import torch

HALF = 1 << 16  # one bf16 unit in the last place, counted in fp32 bit patterns
TIE = 1 << 15  # a low half exactly halfway between two bf16 values
HIGH = 1 if sys.byteorder == "little" else 0  # which int16 of an fp32 pattern holds its bf16 top half


@torch.no_grad()
def split_master(master: torch.Tensor, weight: torch.Tensor, low: torch.Tensor,
                 tie: torch.Tensor | None = None) -> None:
    """Write fp32 `master` as bf16 `weight` (rounded to nearest) and int16 `low`, the difference of
    their bit patterns, so that `join_master(weight, low)` gives `master` back bit for bit. `master`
    is overwritten: the step's rebuilt masters are dropped next, so its memory serves as scratch.

    Bit patterns as integers order the floats of one sign, and rounding to bf16 moves a pattern by
    at most half a bf16 unit (2^15): the difference fits 16 signed bits, except at an exact tie
    that rounds to the even value below (+2^15). Such a tie is stored rounded away from zero instead
    (−2^15). Worked example: 1 + 2^-8 is 0x3F808000, halfway between the bf16 values 1 (0x3F80) and
    1 + 2^-7 (0x3F81); torch rounds it to the even 0x3F80 with a difference of +0x8000, so it is
    stored as 0x3F81 with −0x8000.

    `tie`, a bool tensor of `master`'s shape, is the scratch for the tie mask; given, the split
    allocates nothing (the optimizer step makes it before it changes any weight)."""
    weight.copy_(master)  # round to nearest, ties to even
    bits = master.view(torch.int32)
    bits.sub_(weight.view(torch.int16), alpha=HALF)  # int32 arithmetic; the true result is small
    tie = torch.eq(bits, TIE, out=tie) if tie is not None else bits == TIE
    weight.view(torch.int16).add_(tie)  # one bf16 unit away from zero: the pattern's magnitude grows
    low.copy_(bits.masked_fill_(tie, -TIE))


@torch.no_grad()
def join_master(weight: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 master `split_master` stored as bf16 `weight` and int16 `low` (a new tensor)."""
    bits = weight.view(torch.int16).to(torch.int32).mul_(HALF)  # at most 2^31 − 2^16 in size: no overflow
    return bits.add_(low).view(torch.float32)


@torch.no_grad()
def round_stochastic(values: torch.Tensor, out: torch.Tensor, generator: torch.Generator,
                     noise: torch.Tensor, nan: torch.Tensor) -> None:
    """Write fp32 `values` into bf16 `out`, rounding each element to one of its two bf16 neighbours
    with the probability that makes the expected result the value itself (stochastic rounding).

    A uniform integer in [0, 2^16) is added to each fp32 bit pattern and the low 16 bits dropped:
    a value a fraction f of the way from its lower-magnitude neighbour to the next rounds up with
    probability f. `values` is overwritten (it is the step's scratch). `noise` (int16) and `nan`
    (bool) are scratch of at least `values.numel()` elements, so rounding allocates nothing. The
    draws depend on `generator` and the element count only, so any chunking draws the same noise.
    A NaN stays NaN (its pattern plus noise could wrap to a number)."""
    n = values.numel()
    drawn = torch.randint(-TIE, TIE, (n,), generator=generator, dtype=torch.int16, device=values.device, out=noise[:n])
    round_with_noise(values, out, drawn, nan[:n], offset=TIE)  # drawn + TIE: uniform in [0, 2^16)


def noise_key(seed: int, index: int, step: int) -> int:
    """The stochastic rounding's key for tensor `index` of an optimizer at its step count `step`, from the run's
    seed: it depends on nothing else, so reruns, resumed runs and every rank draw the same noise."""
    return (seed * 0x9E3779B1 + index * 0x85EBCA77 + step * 0xC2B2AE3D) & 0x7FFFFFFF


MASK32 = 0xFFFFFFFF


def _times_mod_2_32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x · constant mod 2^32 for int64 `x` in [0, 2^32), in two halves so no product leaves int64's range."""
    low = x * (constant & 0xFFFF)
    high = (x * (constant >> 16)) & 0xFFFF  # only its low 16 bits survive the shift by 16 below 2^32
    return (low + (high << 16)) & MASK32


@torch.no_grad()
def element_noise(key: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """32 random bits (int64 in [0, 2^32)) for elements `start` … `start + count − 1` of a tensor: Wellons'
    lowbias32 mixer over (key, element index), as cohort_grpo/kernels/adamw.py computes it in uint32 registers."""
    x = torch.arange(start, start + count, dtype=torch.int64, device=device) & MASK32
    x = _times_mod_2_32(x, 0x9E3779B9) ^ (key & MASK32)
    x ^= x >> 16
    x = _times_mod_2_32(x, 0x7FEB352D)
    x ^= x >> 15
    x = _times_mod_2_32(x, 0x846CA68B)
    return x ^ (x >> 16)


@torch.no_grad()
def round_with_noise(values: torch.Tensor, out: torch.Tensor, noise: torch.Tensor, nan: torch.Tensor,
                     offset: int = 0) -> None:
    """Write fp32 `values` into bf16 `out` (same number of elements), rounded stochastically: `noise` + `offset`
    (one per element, in [0, 2^16); `round_stochastic` draws it, `element_noise` hashes it) is added to each fp32
    bit pattern and the low half dropped. `values` is overwritten; `nan` (bool, as many elements) is scratch,
    so rounding allocates nothing. A NaN stays NaN (its pattern plus noise could wrap to a number)."""
    flat = values.view(-1)
    is_nan = torch.ne(flat, flat, out=nan.view(-1))  # NaN alone differs from itself
    bits = flat.view(torch.int32)
    bits.add_(noise.view(-1))  # a pattern near int32's top wraps, as the kernel's does: only NaN/inf patterns
    if offset:
        bits.add_(offset)
    high = bits.view(torch.int16).view(-1, 2)[:, HIGH]
    high.masked_fill_(is_nan, 0x7FC0)  # bf16's quiet NaN
    out.view(-1).view(torch.int16).copy_(high)
