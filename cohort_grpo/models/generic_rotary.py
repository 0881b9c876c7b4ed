"""transformers' rotate-half rotary as one kernel for q and one for k on a `TransformersCausalLM`'s sampling forwards
(generic.py), beside the other fusions of generic_fusion.py.

A modeling module's rotary function is replaced (once, whichever models use it: `RotaryDispatch`) only where the
kernel computes it on random inputs of each attention shape found; the kernel then serves only the calls of a served
decoder's forward (`RotaryScope`) on the sampling path, and of the full width of the head (a partial rotary keeps the
original).
"""

from __future__ import annotations

import sys
import threading

import torch
from torch import nn

from cohort_grpo.kernels import exact_elementwise
from cohort_grpo.kernels.elementwise import rotate_plain, triton_allowed
from cohort_grpo.models.generic_fusion import CHECK_TOLERANCE, Fusions, checked, relative_error

# ---- rotary ------------------------------------------------------------------------------------------------------
# transformers' attentions call their modeling module's global `apply_rotary_pos_emb(q, k, cos, sin)`, with no
# reference to the model: the global becomes a `RotaryDispatch` (once per modeling module, whoever else uses it), and
# a decoder `install` served names its `Fusions` in `SERVING` for the duration of its forward (`RotaryScope`), so
# that only its own calls, on the sampling path, take the kernel.
SERVING = threading.local()  # .stack: the Fusions of the served decoders whose forwards run on this thread
ROTARY_NAME = "apply_rotary_pos_emb"


def serving_fusions() -> Fusions | None:
    stack = getattr(SERVING, "stack", None)
    return stack[-1] if stack else None


def rotary_kernel(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q·cos + rotate_half(q)·sin and the same for k (q [B, H, T, D], k [B, H_kv, T, D], cos/sin [B or 1, T, D]):
    the kernel where triton runs, else its torch reference."""
    cos, sin = (t.expand(q.shape[0], -1, -1) for t in (cos, sin))
    if triton_allowed(q):
        return exact_elementwise.rotate_kernel(q, cos, sin), exact_elementwise.rotate_kernel(k, cos, sin)
    return rotate_plain(q, k, cos, sin)


def rotary_servable(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary_kernel` serves the call: q and k [B, heads, T, D], full-width cos/sin [B or 1, T, D], one
    dtype (a partial rotary's narrower cos/sin keeps the original)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)) or (q.dim(), k.dim(), cos.dim()) != (4, 4, 3):
        return False
    batch, _, length, dim = q.shape
    return (dim % 2 == 0 and k.shape[0] == batch and tuple(k.shape[2:]) == (length, dim) and sin.shape == cos.shape
            and cos.shape[0] in (1, batch) and tuple(cos.shape[1:]) == (length, dim)
            and len({q.dtype, k.dtype, cos.dtype, sin.dtype}) == 1)


class RotaryDispatch:
    """A modeling module's `apply_rotary_pos_emb`: `rotary_kernel` for a call of a served decoder's forward on the
    sampling path that the kernel serves, the original for every other call."""

    def __init__(self, original, module_name: str):
        self.original, self.module_name = original, module_name

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        fusions = serving_fusions()
        if (args or kwargs or fusions is None or self.module_name not in fusions.rotary_modules
                or not fusions.active() or not rotary_servable(q, k, cos, sin) or not triton_allowed(q)):
            return self.original(q, k, cos, sin, *args, **kwargs)
        return rotary_kernel(q, k, cos, sin)


class RotaryScope:
    """The served decoder's forward hooks: its `Fusions` on `SERVING` while its forward runs."""

    def __init__(self, fusions: Fusions):
        self.fusions = fusions

    def enter(self, module, args) -> None:
        if not hasattr(SERVING, "stack"):
            SERVING.stack = []
        SERVING.stack.append(self.fusions)

    def leave(self, module, args, output) -> None:
        SERVING.stack.pop()


@torch.no_grad()
def rotary_agrees(original, heads: int, kv_heads: int, head_dim: int, device: torch.device) -> bool:
    """Whether `rotary_kernel` computes `original` on random float32 q, k, cos and sin of these shapes (cos/sin per
    row, and one for all rows), within `CHECK_TOLERANCE`."""
    generator = torch.Generator(device).manual_seed(0)
    batch, length = 2, 5
    q, k = (torch.randn(batch, n, length, head_dim, generator=generator, device=device) for n in (heads, kv_heads))
    for rows in (batch, 1):
        cos, sin = (torch.randn(rows, length, head_dim, generator=generator, device=device) for _ in range(2))
        own, ours = original(q, k, cos, sin), rotary_kernel(q, k, cos, sin)
        if len(own) != 2 or any(o.shape != r.shape or relative_error(o, r) > CHECK_TOLERANCE
                                for o, r in zip(ours, own)):
            return False
    return True


def attention_shapes(decoder: nn.Module) -> dict[str, set[tuple[int, int, int]]]:
    """Per modeling module, the (heads, kv heads, head dim) of its attention modules in `decoder` (those with a
    `head_dim`; the head counts of their q and k projections, or a stand-in where they are joined)."""
    found: dict[str, set[tuple[int, int, int]]] = {}
    for module in decoder.modules():
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim <= 0:
            continue
        q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
        heads = ((q.out_features // head_dim, k.out_features // head_dim)
                 if isinstance(q, nn.Linear) and isinstance(k, nn.Linear) else (2, 1))
        found.setdefault(type(module).__module__, set()).add((*heads, head_dim))
    return found


def install_rotary(decoder: nn.Module, fusions: Fusions) -> None:
    """Serve `decoder`'s rotary by the kernel: each modeling module of its attention modules whose global
    `apply_rotary_pos_emb` `rotary_agrees` at each of their shapes gets a `RotaryDispatch` (the one it has, where an
    earlier model put it), and the decoder a `RotaryScope`; `fusions` counts them."""
    parameter, memo = next(decoder.parameters(), None), {}
    served = set()
    for name, shapes_found in sorted(attention_shapes(decoder).items()):
        modeling = sys.modules.get(name)
        current = getattr(modeling, ROTARY_NAME, None)
        if parameter is None or current is None or not callable(current):
            continue
        original = current.original if isinstance(current, RotaryDispatch) else current
        if all(checked(lambda: rotary_agrees(original, *shape, parameter.device), (ROTARY_NAME, name, shape), memo)
               for shape in sorted(shapes_found)):
            if not isinstance(current, RotaryDispatch):
                setattr(modeling, ROTARY_NAME, RotaryDispatch(original, name))
            served.add(name)
    if served:
        fusions.rotaries, fusions.rotary_modules = len(served), frozenset(served)
        scope = RotaryScope(fusions)
        decoder.register_forward_pre_hook(scope.enter)
        decoder.register_forward_hook(scope.leave, always_call=True)
