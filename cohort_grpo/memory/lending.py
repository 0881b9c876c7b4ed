"""Gradients that live in the rollout engine's idle KV cache during the update.

A GRPO step uses its memory in phases. The engine's KV cache (4.4 GiB for 256 sequences of 640
tokens at the Qwen2.5-1.5B shape) holds keys and values only while sampling; the engine keeps it
allocated between steps because its CUDA graphs read it by address. The gradients (2 bytes a
parameter in bf16, 2.9 GiB at 1.5B) exist only from the first backward to the optimizer step. The
two lifetimes never overlap, so the gradients can borrow the cache's bytes instead of allocating
their own, and the update's memory peak falls by the bytes lent. That room is what lets more layers
keep their activations (`gradient_checkpointing_layers`) under the same peak.

The loan is for one update: it points each parameter's `.grad` at a zeroed slice of the cache
(autograd then accumulates into it in place), and on return drops those gradients and zeroes the
slices, so the engine gets back a cache in the state it was allocated in (finite values; what the
cache held before was dead anyway, every sequence is prefilled anew).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

ALIGN_BYTES = 256  # every lent slice starts at this alignment, as the CUDA caching allocator's blocks do


@contextmanager
def lend_gradients(params: Iterable[torch.Tensor], buffers: list[torch.Tensor]) -> Iterator[int]:
    """Inside the block, the gradients of `params` that fit live in `buffers` (first fit, largest
    first); yields the bytes lent. Parameters that fit nowhere get ordinary gradients.

    Every parameter must have no gradient on entry (zero_grad(set_to_none=True) first). On exit
    their `.grad` is None and the used bytes of each buffer are zero.
    """
    params = [p for p in params if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise RuntimeError("lend_gradients: a parameter already has a gradient; call zero_grad(set_to_none=True) first")
    # Inference tensors cannot be written outside inference mode: such a buffer lends nothing.
    slots = [_bytes_of(b) for b in buffers if b.is_contiguous() and not b.is_inference()]
    used = [0] * len(slots)
    for param in sorted(params, key=lambda p: p.numel() * p.element_size(), reverse=True):
        size = param.numel() * param.element_size()
        for i, slot in enumerate(slots):
            start = -(-used[i] // ALIGN_BYTES) * ALIGN_BYTES
            if slot.device == param.device and start + size <= slot.numel():
                grad = slot[start:start + size].view(param.dtype).view(param.shape)
                grad.zero_()
                param.grad = grad  # autograd accumulates into an existing .grad in place
                used[i] = start + size
                break
    try:
        yield sum(used)
    finally:
        for param in params:
            param.grad = None
        for slot, n in zip(slots, used):
            if n:
                slot[:n].zero_()


def idle_buffers(sampler) -> list[torch.Tensor]:
    """The memory a sampler does not need between its calls (the engine's KV cache), or none."""
    return list(getattr(sampler, "idle_buffers", lambda: [])())


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)
