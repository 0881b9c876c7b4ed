"""Training a `TransformersCausalLM` (generic.py) as cohort trains its own models: by decoder layer.

The native `CausalLM` knows its layers (`model.model.layers`); a transformers model of any family keeps them under
its own name (`model.layers`, `gpt_neox.layers`, `transformer.h`, ...). `decoder_layer_list` finds them without
naming the family: the longest `nn.ModuleList` of the decoder whose modules are all of one class (the repeated
block), which is what per-layer gradient checkpointing (`checkpoint_first_layers`) and FSDP2's per-layer units
(cohort_grpo/parallel/sharding.py) need. `is_mixture_of_experts` reads a config's expert count under the names
transformers' families give it, for the options the generic path refuses on such models (routing replay).
"""

from __future__ import annotations

import torch
from torch import nn

from cohort_grpo.errors import CohortError

# The config attributes transformers' mixture-of-experts families count their routed experts under.
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def decoder_layer_list(decoder: nn.Module) -> nn.ModuleList:
    """The decoder's repeated layers: its longest `nn.ModuleList` whose modules share one class (ties: the first
    in module order). A one-line error where the decoder holds none."""
    best = None
    for module in decoder.modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best):
                best = module
    if best is None:
        raise CohortError(f"found no list of decoder layers in {type(decoder).__name__}; per-layer gradient "
                          "checkpointing and FSDP2 need one: unset gradient_checkpointing_layers / fsdp")
    return best


def checkpoint_first_layers(layers: nn.ModuleList, checkpointed: int | None, probe=None) -> None:
    """Recompute in the backward only the first `checkpointed` of `layers` (None: all), as `CausalLM` does; the
    others keep their activations. Each layer is a transformers `GradientCheckpointingLayer` already set up by
    the model's own `gradient_checkpointing_enable`; its `gradient_checkpointing` flag decides. `probe`
    (memory/checkpointed_layers.py's `ActivationProbe`) measures the first kept layer's forward."""
    count = len(layers) if checkpointed is None else checkpointed
    if not 0 <= count <= len(layers):
        raise CohortError(f"gradient_checkpointing_layers={checkpointed} is not between 0 and the model's "
                          f"{len(layers)} decoder layers")
    missing = [type(layer).__name__ for layer in layers if not hasattr(layer, "gradient_checkpointing")]
    if missing:
        raise CohortError(f"{missing[0]} layers have no per-layer gradient checkpointing in transformers; "
                          "unset gradient_checkpointing_layers (every layer is then recomputed)")
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < count
        for handle in getattr(layer, "cohort_probe_hooks", ()):
            handle.remove()
        layer.cohort_probe_hooks = ()
    if probe is not None and count < len(layers):
        layers[count].cohort_probe_hooks = attach_probe(layers[count], probe)


def attach_probe(layer: nn.Module, probe) -> tuple:
    """Hooks around `layer`'s forward that give `probe` what the layer keeps for its backward (training forwards
    with gradients only): the allocator's count before and after, less its output, per token."""
    before = []

    def start(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            before.append(probe.allocated())

    def stop(module, args, kwargs, output):
        if before:
            hidden = output[0] if isinstance(output, tuple) else output
            probe.record(probe.allocated() - before.pop(), hidden, hidden.shape[0] * hidden.shape[1])

    return (layer.register_forward_pre_hook(start, with_kwargs=True),
            layer.register_forward_hook(stop, with_kwargs=True))


def is_mixture_of_experts(config) -> bool:
    """Whether a transformers config describes routed experts (an `EXPERT_COUNTS` attribute above 1)."""
    return any(isinstance(getattr(config, name, None), int) and getattr(config, name) > 1 for name in EXPERT_COUNTS)
