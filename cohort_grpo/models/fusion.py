"""One GEMM for q/k/v and one for gate/up while sampling, without a second copy of the weights.

A decode step multiplies a few hundred rows by each weight matrix: each GEMM is short, and the
step pays a launch and a ramp-up per matrix. Reading q, k and v (and gate and up) from one matrix
halves those GEMMs. Instead of concatenating copies, the separate parameters are re-pointed to
consecutive slices of one buffer (`param.data = buffer[rows]`): state-dict names, the optimizer's
parameters and their in-place updates stay as they were, and the concatenated matrix is simply a
view of that buffer, always current. Training keeps using the separate parameters (autograd needs
them as leaves); only no-grad forwards read the fused view.

If something later gives a parameter its own storage again (`model.to(...)`, loading with
assign=True), `fused_weight` notices that the slices are no longer consecutive and fuses anew.
"""

from __future__ import annotations

import torch
from torch import nn


def _consecutive(tensors: list[torch.Tensor]) -> bool:
    """Whether the tensors are contiguous, back to back in one storage, in this order."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               and t.dtype == first.dtype for t in tensors):
        return False
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return False
        offset += t.numel()
    return True


def _view_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The consecutive `tensors` seen as one tensor concatenated along dim 0 (no copy)."""
    first = tensors[0]
    rows = sum(t.shape[0] for t in tensors)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]),
                                   first.stride())


@torch.no_grad()
def fused_weight(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [sum of out features, in], bias or None) of `linears` as one view, re-pointing the
    parameters into a shared buffer on first use; None when they cannot be fused (not plain
    nn.Linear, e.g. a LoRA-wrapped layer, or mixed bias / dtype / device)."""
    if not all(type(layer) is nn.Linear for layer in linears):
        return None
    weights = [layer.weight for layer in linears]
    biases = [layer.bias for layer in linears]
    has_bias = biases[0] is not None
    if any((b is not None) != has_bias for b in biases):
        return None
    if len({(w.dtype, w.device, w.shape[1:]) for w in weights}) != 1:
        return None
    for params in (weights, biases) if has_bias else (weights,):
        if not _consecutive([p.data for p in params]):
            buffer = torch.cat([p.data for p in params])
            start = 0
            for p in params:
                p.data = buffer[start: start + p.shape[0]]
                start += p.shape[0]
    weight = _view_rows([w.data for w in weights])
    bias = _view_rows([b.data for b in biases]) if has_bias else None
    return weight, bias
