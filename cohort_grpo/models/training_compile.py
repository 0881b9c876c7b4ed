"""torch.compile of one decoder layer for the training forward and backward.

Eager PyTorch runs each RMSNorm, rotary embedding, SwiGLU gate and residual add as separate
memory-bound kernels, and autograd keeps every intermediate for the backward pass. Compiled,
the elementwise work fuses into the GEMMs' neighbours, and the partitioner (AOTAutograd's
min-cut) saves fewer, cheaper-to-recompute activations. One compiled function serves all layers:
the layer is an argument, its parameters graph inputs (torchtitan compiles per block the same
way). Length-bucketed micro-batches vary in batch and length: after the first shape, torch.compile
recompiles once with those two dimensions dynamic and the model's own sizes still static.
A mixture-of-experts layer is compiled the same way: its routing comes as a per-layer record
(`moe.LayerRouting`), so one graph serves every MoE layer (and one every dense layer), and its
grouped products are custom ops (`grouped_mm.py`) the graph calls as they are.

Used for the full-sequence forwards (training, and the no-grad log-prob passes); never with a KV
cache: sampling has its own compiled pieces (`elementwise.py`) inside CUDA graphs. A compilation
failure prints one notice and falls back to eager.
"""

from __future__ import annotations

import sys

import torch
import torch.utils.checkpoint

from cohort_grpo.models.shared_prefix import is_packed


_CONTROL_FLOW = tuple(c for c in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),) if c)


def run_layer(layer, hidden, cos, sin, mask, **layer_args):
    """A decoder layer's full-sequence forward as a function of the layer (what is compiled, and what
    activation checkpointing recomputes); `layer_args`: a mixture-of-experts layer's routing."""
    return layer(hidden, cos, sin, mask, **layer_args)


class CompiledLayerCall:
    def __init__(self):
        # Shapes static at first; the first new batch or length recompiles with those dimensions dynamic.
        self.compiled = torch.compile(run_layer)
        self.failed = False

    def __call__(self, layer, hidden, cos, sin, mask, **layer_args):
        if is_packed(mask):
            # A shared-prompt micro-batch's token count changes with its completions' lengths, nearly
            # every time: compile for any count from the first call, not once more mid-run.
            routing = layer_args.get("routing")  # a MoE layer's recorded ids: one row of the same tokens
            recorded = () if routing is None or routing.recorded is None else ((routing.recorded, (1,)),)
            for tensor, dims in ((hidden, (1,)), (cos, (1,)), (sin, (1,)), (mask.rows, (0, 1)), (mask.slots, (0,)),
                                 *recorded):
                for dim in dims:
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
        if not self.failed:
            try:
                return self.compiled(layer, hidden, cos, sin, mask, **layer_args)
            except _CONTROL_FLOW:
                raise  # activation checkpointing stops its recomputation early by raising this
            except Exception as error:  # no triton / no C++ compiler / an op inductor cannot lower
                self.failed = True
                message = (str(error).strip().splitlines() or [""])[0][:200]
                print(f"cohort: torch.compile of the training layer failed ({type(error).__name__}: {message}); "
                      "training continues uncompiled", file=sys.stderr)
        return layer(hidden, cos, sin, mask, **layer_args)
