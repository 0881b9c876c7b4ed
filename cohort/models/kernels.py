"""The decoder's elementwise pieces as small functions that torch.compile can fuse.

A decode step of a small model is bound by kernel launches, not bytes: written as plain torch
ops, an RMSNorm is seven kernels, a rotary embedding of q and k a dozen, SwiGLU's gate two, and
the sampler (Gumbel noise, argmax, log-softmax over a 150k vocabulary) a score more. Compiled,
each becomes one or two fused kernels, and a captured CUDA graph replays far fewer launches.
nano-vllm compiles the same small pieces and captures the rest of the step as a graph; that
keeps compilation to seconds (small graphs, shared by every layer), unlike compiling a whole
24-layer step.

`fused_kernels(True)` switches the compiled versions on (the engine does, while it samples on
CUDA with triton available); the plain versions are the reference and the CPU path, and the
training forward always uses them.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.fx.experimental._config
import torch.nn.functional as F

_state = {"on": False}
_compiled: dict[str, object] = {}
_failed: set[str] = set()


def rms_norm_plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x²) + eps) computed in float32, cast back (as transformers' LlamaRMSNorm)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_plain(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding of q [B, H, T, D] and k [B, H_kv, T, D] (rotate-half layout of HF
    checkpoints; Su et al. 2021), cos/sin [B, T, D]."""
    cos, sin = cos[:, None], sin[:, None]

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)


def swiglu_gate_plain(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the SwiGLU gate (Shazeer 2020)."""
    return F.silu(gate) * up


def fused(name: str, plain):
    """The compiled version of `plain` when fused kernels are on, else `plain` itself. If compiling
    it fails (no triton, an op the backend cannot generate), one notice, and `plain` from then on."""
    if not _state["on"] or name in _failed:
        return plain
    fn = _compiled.get(name)
    if fn is None:
        # Without this, a batch width that happens to equal another dimension (64 rows, head_dim
        # 64) is "duck-sized" into one symbol, and the next width recompiles.
        torch.fx.experimental._config.use_duck_shape = False
        fn = _compiled[name] = torch.compile(plain, dynamic=True)

    def guarded(*args):
        try:
            return fn(*args)
        except Exception as error:  # noqa: BLE001 - only compiler failures are absorbed
            if not type(error).__module__.startswith(("torch._dynamo", "torch._inductor", "triton")):
                raise
            _failed.add(name)
            first_line = (str(error).strip().splitlines() or [""])[0][:160]
            print(f"cohort: torch.compile of {name} failed ({type(error).__name__}: {first_line}); "
                  "using plain torch ops for it", file=sys.stderr)
            return plain(*args)

    return guarded


def rms_norm(x, weight, eps):
    return fused("rms_norm", rms_norm_plain)(x, weight, eps)


def rotate(q, k, cos, sin):
    return fused("rotate", rotate_plain)(q, k, cos, sin)


def swiglu_gate(gate, up):
    return fused("swiglu_gate", swiglu_gate_plain)(gate, up)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def fused_kernels(on: bool = True):
    """Use the compiled pieces inside the block (for sampling; nothing here needs autograd)."""
    previous = _state["on"]
    _state["on"] = on
    try:
        yield
    finally:
        _state["on"] = previous
