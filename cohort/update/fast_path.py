"""What `auto` means for the update's speed options, once the device and the model are known.

A bare `GRPOConfig` gets the configuration that measured fastest (docs/performance.md): on a GPU
with cohort's own models,

- `torch_compile=auto`: each decoder layer's training forward and backward compiled
  (cohort/kernels/training_compile.py), where triton is installed, except under FSDP;
- `gradient_checkpointing=auto`: only as many layers recompute their activations as the memory
  budget needs (`max_memory_gib`, default 90% of the card), measured in the first update
  (cohort/memory/checkpointed_layers.py). Where everything fits, no layer recomputes: the fastest
  update. A smaller budget trades speed for memory.

Micro-batches stay as large as `per_device_train_batch_size` allows: capping their tokens to save
memory measured slower than recomputing layers (each micro-batch pays a fixed cost of launches),
e.g. 2.85 s against 2.55 s for the 1.5B shape's update with one prompt group per micro-batch.

On a CPU both are off (no triton kernels, and host memory is rarely what limits a CPU run); other
model implementations (transformers) recompute every layer on a GPU, TRL's default. Each option,
given explicitly, is left as given.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_fast_path(args, model, device: torch.device, *, compiles: bool | None = None):
    """`args` with every `auto` speed option replaced by its value for this device and model.

    `model` is the policy as loaded; cohort's own models have `compile_for_training`. `compiles`
    says whether triton can compile here (default: whether it is installed)."""
    ours = hasattr(model, "compile_for_training")
    gpu = device.type == "cuda"
    if compiles is None:
        compiles = triton_available()
    changes = {}
    if args.torch_compile == "auto":  # FSDP2 hooks the layers the compiled function would call: left out there
        changes["torch_compile"] = bool(gpu and ours and compiles and not args.fsdp)
    if args.gradient_checkpointing == "auto":
        # A layer count or budget given with auto asks for checkpointing, on any device.
        changes["gradient_checkpointing"] = gpu or args.gradient_checkpointing_layers is not None
        if gpu and ours and args.gradient_checkpointing_layers is None:
            changes["gradient_checkpointing_layers"] = "auto"
    return dataclasses.replace(args, **changes) if changes else args


def fast_path_line(args) -> str:
    """One log line: what the update runs with."""
    layers = args.gradient_checkpointing_layers
    checkpointing = ("off" if not args.gradient_checkpointing else "every layer" if layers is None
                     else "only the layers the memory budget needs" if layers == "auto" else f"{layers} layers")
    tokens = args.max_tokens_per_micro_batch
    return (f"update: torch_compile {'on' if args.torch_compile else 'off'}, gradient checkpointing {checkpointing}, "
            f"micro-batches of {args.per_device_train_batch_size} completions"
            f"{f' / {tokens:,} tokens' if tokens else ''}")
