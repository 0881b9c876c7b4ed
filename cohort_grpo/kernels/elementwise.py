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
training forward always uses them. Two parts of the step are hand-written Triton kernels instead,
used on that same path (`triton_kernel_on`): the decode attention (`decode_attention.py`) and the
default sampling step (`sampling.py` in this folder).

With them on and autograd off (`fused_path()`), the model also regroups its decode forward into
fewer, larger pieces (see `CausalLM.forward`): each residual add is computed together with the
RMSNorm that follows it (`add_rms_norm`), q/k normalisation, rotary and the KV-cache write are one
piece (`rotate_and_cache`), and the attention mask is built once per step as the additive bias
SDPA would otherwise rebuild from a boolean mask in every layer (`cache_attention_bias`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading

import torch
import torch.fx.experimental._config
import torch.nn.functional as F

# COHORT_TRITON_KERNELS=0 keeps the hand-written Triton kernels (decode attention, sampling) off
# and leaves those two to cuDNN's SDPA and the compiled torch version: a diagnostic switch, so a
# benchmark can time the engine with and without them in one process.
_state = {"triton": os.environ.get("COHORT_TRITON_KERNELS", "1") != "0"}


class _Switch(threading.local):
    """Whether fused kernels are on, per thread: asynchronous rollouts sample on a producer thread while
    the main thread runs no-grad forwards (log-probs, evaluation) that must keep the plain path."""

    on = False
    compile = True


_switch = _Switch()
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


def add_rms_norm_plain(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)): a residual add and the RMSNorm after it, the pair a
    pre-norm block computes at every sub-block boundary (Zhang & Sennrich 2019)."""
    residual = x + delta
    return residual, rms_norm_plain(residual, weight, eps)


def rotate_and_cache_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, q_norm_weight: torch.Tensor | None,
                           k_norm_weight: torch.Tensor | None, eps: float, cache_k: torch.Tensor,
                           cache_v: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The decode step's attention inputs: q [B, T, H, D], k/v [B, T, H_kv, D] straight from the
    projection; q/k RMS-normalised per head when norm weights are given (Qwen3), rotated; k and v
    stored at `[b, :, position_ids[b, t]]` of the layer's caches `[rows, H_kv, max_len, D]` (batch
    row b is cache row b, as `KVCache.write` with cache_rows None). Returns q [B, H, T, D].

    The same operations as the unfused path (RMSNorm modules, `rotate`, `KVCache.write`), as one
    function so a compiler writes rotated keys straight into the cache: the caches are whole
    tensors, not views, so the in-place write stays in place under torch.compile."""
    if q_norm_weight is not None:
        q, k = rms_norm_plain(q, q_norm_weight, eps), rms_norm_plain(k, k_norm_weight, eps)
    q, k = rotate_plain(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    rows = torch.arange(q.shape[0], device=q.device)[:, None]
    # advanced indices on dims 0 and 2 put the broadcast [B, T] dims first: the value is [B, T, H_kv, D]
    cache_k[rows, :, position_ids] = k.transpose(1, 2).to(cache_k.dtype)
    cache_v[rows, :, position_ids] = v.to(cache_v.dtype)
    return q


# The additive value of a hidden key: what SDPA's cuDNN path itself puts in place of False
# (convert_boolean_attn_mask_cudnn, aten/src/ATen/native/transformers/attention.cpp). The other
# backends turn False into -inf instead; both give exactly zero weight (exp underflows to 0, and the
# row maximum comes from an allowed key), so they agree wherever a query sees at least one key,
# which every decode query does (its own).
HIDDEN_KEY_BIAS = -65504.0


def cache_attention_bias_plain(position_ids: torch.Tensor, cache_len: int, window: int | None,
                               dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, T, cache_len] in `dtype`: 0 where the query at position p may see the
    key at position j (j <= p, and j > p - window for a sliding window), HIDDEN_KEY_BIAS elsewhere.
    A boolean mask passed to SDPA is converted to this form inside every call, i.e. in every layer;
    built once it serves all layers of a step."""
    return torch.where(cache_keys_visible(position_ids, cache_len, window), 0.0, HIDDEN_KEY_BIAS).to(dtype)[:, None]


def cache_keys_visible(position_ids: torch.Tensor, cache_len: int, window: int | None) -> torch.Tensor:
    """Bool [B, T, cache_len]: whether the query at position p sees the key at position j of its
    cache row (j <= p, and j > p - window for a sliding window)."""
    key_positions = torch.arange(cache_len, device=position_ids.device)
    visible = key_positions <= position_ids[:, :, None]
    if window is not None:
        visible = visible & (key_positions > position_ids[:, :, None] - window)
    return visible


def fused_path() -> bool:
    """Whether a forward takes the sampling path's regrouped pieces: fused kernels on and autograd
    off (a training forward never does, so its math is the plain one)."""
    return _switch.on and not torch.is_grad_enabled()


def triton_allowed(tensor: torch.Tensor) -> bool:
    """Whether a hand-written Triton kernel may run on `tensor`: on CUDA, triton importable, and
    not switched off (COHORT_TRITON_KERNELS=0, for A/B runs)."""
    return _state["triton"] and tensor.is_cuda and triton_available()


def triton_kernel_on(tensor: torch.Tensor) -> bool:
    """Whether the sampling path may use a hand-written Triton kernel on `tensor`: fused kernels
    on and compiled, autograd off, and `triton_allowed`."""
    return _switch.on and _switch.compile and not torch.is_grad_enabled() and triton_allowed(tensor)


def fused(name: str, plain):
    """The compiled version of `plain` when fused kernels are on, else `plain` itself. If compiling
    it fails (no triton, an op the backend cannot generate), one notice, and `plain` from then on."""
    if not _switch.on or not _switch.compile or name in _failed:
        return plain
    fn = _compiled.get(name)
    if fn is None:
        # Shapes static at first (every dimension specialised: hidden size, head size, vocabulary),
        # then, when a new batch width or cache length arrives, one recompile with only that
        # dimension dynamic (torch.compile's default). Compiling with every dimension dynamic
        # instead made the decode step markedly slower, mostly in the KV-cache write and rotary
        # kernel, which symbolic sizes keep from specialising (docs/history/benchmarks-2026-11.md).
        # Duck sizing off: a width equal to another dimension (64 rows, head_dim 64) must not be
        # fused into one symbol.
        torch.fx.experimental._config.use_duck_shape = False
        fn = _compiled[name] = torch.compile(plain)

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


def add_rms_norm(x, delta, weight, eps):
    return fused("add_rms_norm", add_rms_norm_plain)(x, delta, weight, eps)


def rotate_and_cache(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, cache_k, cache_v, position_ids):
    return fused("rotate_and_cache", rotate_and_cache_plain)(q, k, v, cos, sin, q_norm_weight, k_norm_weight,
                                                             eps, cache_k, cache_v, position_ids)


def cache_attention_bias(position_ids, cache_len, window, dtype):
    return fused("cache_attention_bias", cache_attention_bias_plain)(position_ids, cache_len, window, dtype)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def fused_kernels(on: bool = True, compile: bool = True):
    """Use the fused pieces inside the block (for sampling; nothing here needs autograd), compiled
    unless `compile` is False (then their plain versions: the regrouped forward on plain ops, which
    tests compare with both the unfused and the compiled forward)."""
    previous = (_switch.on, _switch.compile)
    _switch.on, _switch.compile = on, compile
    try:
        yield
    finally:
        _switch.on, _switch.compile = previous
