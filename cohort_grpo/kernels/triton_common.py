"""What cohort's Triton kernels share: the optional import, the decorator and the combine functions
of their reductions (decode attention, the sampler, the LM-head statistics).

tl.max/tl.min/tl.sum are themselves @triton.jit helpers of triton.language, which Triton's
interpreter (CPU tests, TRITON_INTERPRET=1) cannot call when triton.language was imported before
the variable was set, and torch imports it early. tl.reduce with the combine functions those
helpers use compiles to the same code, and the interpreter reduces with them on its vectorised
path; ours stand in should Triton rename them.
"""

from __future__ import annotations

try:  # triton is optional: without it every kernel has a torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

# The decorator for kernels that must import without triton. Whether a kernel runs compiled or in
# the interpreter is decided when it is decorated, at its module's import.
jit = triton.jit if triton is not None else (lambda fn: fn)

MAX_COMBINE = MIN_COMBINE = SUM_COMBINE = None
if triton is not None:

    @triton.jit
    def _maximum(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _minimum(a, b):
        return tl.minimum(a, b)

    @triton.jit
    def _add(a, b):
        return a + b

    MAX_COMBINE = getattr(tl.standard, "_elementwise_max", _maximum)
    MIN_COMBINE = getattr(tl.standard, "_elementwise_min", _minimum)
    SUM_COMBINE = getattr(tl.standard, "_sum_combine", _add)
