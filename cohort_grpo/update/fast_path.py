"""What `auto` means for the update's speed options, once the device and the model are known.

A bare `GRPOConfig` gets the configuration that measured fastest (docs/performance.md): on a GPU
with cohort's own models,

- `torch_compile=auto`: each decoder layer's training forward and backward compiled
  (cohort_grpo/models/training_compile.py), where triton is installed, except under FSDP;
- `gradient_checkpointing=auto`: only as many layers recompute their activations as the memory
  budget needs (`max_memory_gib`, default 90% of the card), measured in the first update
  (cohort_grpo/memory/checkpointed_layers.py). Where everything fits, no layer recomputes: the fastest
  update. A smaller budget trades speed for memory.

- `max_tokens_per_micro_batch=auto`: micro-batches of about `MICRO_BATCH_FLOP` of forward and
  backward work (6 × active parameters × tokens): 11,776 tokens at 1.5B, 36,864 at 0.5B, 2,304 at 7B; a
  mixture of experts counts its experts at their routed share (11,264 at the 1B-active, 7B-total shape). Each
  micro-batch pays a fixed cost on the host (launching a compiled layer's kernels, the head's chunks),
  which the GPU's work on it must hide; past that size a larger micro-batch only keeps more
  activations alive, and a smaller one leaves the host cost exposed (the measurements behind the
  constant: docs/performance.md). A small model needs more tokens to hide the same host cost.

On a CPU all three are off (no triton kernels, and host memory is rarely what limits a CPU run);
other model implementations (transformers) recompute every layer on a GPU, TRL's default, in
micro-batches of `per_device_train_batch_size` rows only. Each option, given explicitly, is left as
given.
"""

from __future__ import annotations

import importlib.util

import torch

from cohort_grpo.models.moe import active_shares

MICRO_BATCH_FLOP = 1.1e14  # `max_tokens_per_micro_batch=auto` with our models on a GPU: work per micro-batch


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def fast_path_settings(args, model, device: torch.device, *, compiles: bool | None = None) -> dict:
    """The `auto` speed options of `args` with their values for this device and model (the others: absent).

    `model` is the policy as loaded; cohort's own models have `compile_for_training`. `compiles`
    says whether triton can compile here (default: whether it is installed)."""
    ours = hasattr(model, "compile_for_training")
    gpu = device.type == "cuda"
    if compiles is None:
        compiles = triton_available()
    changes = {}
    if args.torch_compile == "auto":  # FSDP2 hooks the layers the compiled function would call: left out there
        # exact numerics: compiling would fuse the layer's rounding points away on the trainer's side only
        exact = getattr(args, "rollout_numerics", "fast") == "exact"
        changes["torch_compile"] = bool(gpu and ours and compiles and not args.fsdp and not exact)
    if args.gradient_checkpointing == "auto":
        # A layer count or budget given with auto asks for checkpointing, on any device.
        changes["gradient_checkpointing"] = gpu or args.gradient_checkpointing_layers is not None
        if gpu and ours and args.gradient_checkpointing_layers is None:
            changes["gradient_checkpointing_layers"] = "auto"
    if args.max_tokens_per_micro_batch == "auto":
        changes["max_tokens_per_micro_batch"] = micro_batch_tokens(model) if gpu and ours else 0
    return changes


def micro_batch_tokens(model) -> int:
    """`tokens_for_work` of `model`'s active parameters: every weight, a mixture of experts' expert weights at
    their routed share (`moe.active_shares`), since a token's work is what it passes through, not what the
    model holds (a 7B-total, 1B-active model does a 1B model's work a token)."""
    shares = active_shares(model)
    return tokens_for_work(sum(p.numel() * shares.get(id(p), 1.0) for p in model.parameters()))


def tokens_for_work(active_parameters: float) -> int:
    """Tokens of a training micro-batch that does `MICRO_BATCH_FLOP` of work through `active_parameters`
    weights (forward and backward: 6 FLOPs a weight a token), in multiples of 256, at least 1,024."""
    return max(1024, int(MICRO_BATCH_FLOP / (6 * max(1.0, active_parameters))) // 256 * 256)


def fast_path_line(args) -> str:
    """One log line: what the update runs with."""
    layers = args.gradient_checkpointing_layers
    checkpointing = ("off" if not args.gradient_checkpointing else "every layer" if layers is None
                     else "only the layers the memory budget needs" if layers == "auto" else f"{layers} layers")
    tokens = args.max_tokens_per_micro_batch
    return (f"update: torch_compile {'on' if args.torch_compile else 'off'}, gradient checkpointing {checkpointing}, "
            f"micro-batches of {args.per_device_train_batch_size} completions"
            f"{f' / {tokens:,} tokens' if tokens else ''}")
