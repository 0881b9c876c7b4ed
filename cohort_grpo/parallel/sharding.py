"""FSDP2's sharded copy of a model, built shard first: no rank ever holds a second whole copy.

`fully_shard` shards the parameters a module already holds, so sharding a whole copy first costs that copy on
every rank; widened to fp32 for the master weights it is 4 bytes a parameter (128 GB at 32B, on one GPU,
before any rank has sharded anything). Here the copy is made on the meta device (shapes only), widened and
sharded there, and only then does each rank allocate its shards and fill them from the model's slices, cast
one slice at a time. Besides the model it was given, a rank holds its shards and nothing else.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from cohort_grpo.errors import CohortError
from cohort_grpo.models.generic import TransformersCausalLM


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one: our `DecoderLayer`s, Hugging Face's
    `*DecoderLayer` / `*Block` modules, outermost only: a mixture of experts' `SparseMoeBlock` inside a
    layer is part of its layer's unit (FSDP2 cannot shard a parameter its layer's unit already sharded). A model on
    the generic path names its own: its decoder's list of repeated layers, whatever their class is called. A
    vision-language model's vision tower stays in the root's unit, gathered in every forward on every rank: a frozen
    tower's kept features skip it in some forwards, so units of its own would gather on some ranks only."""
    if isinstance(model, TransformersCausalLM):
        return list(model.decoder_layers())
    layers, prefixes = [], []
    for name, module in model.named_modules():
        if type(module).__name__.endswith(("DecoderLayer", "Block")) and not any(
                name.startswith(prefix) for prefix in prefixes):
            layers.append(module)
            prefixes.append(f"{name}.")
    return layers


def fully_sharded_copy(model: nn.Module, mesh, device: torch.device, master_weights: bool) -> nn.Module:
    """A copy of `model` sharded by FSDP2 over `mesh`, one decoder layer per unit, its shards on `device`.
    `master_weights`: fp32 shards, bf16 gathers and compute, fp32 gradient reduction; otherwise the shards keep
    `model`'s dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    sharded = meta_copy(model)
    policy = MixedPrecisionPolicy()
    if master_weights:
        sharded.float()  # meta parameters: no memory; the buffers (rotary tables) widened as a whole copy's were
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = decoder_layers(sharded)
    if not layers:
        raise CohortError(f"--fsdp found no decoder layers in {type(model).__name__} to shard; use DDP "
                          "(leave out --fsdp) for this model")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(sharded, mesh=mesh, mp_policy=policy)
    fill_shards(sharded, model, device, mesh.get_local_rank(), mesh.size())
    return sharded


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters are on the meta device (shapes, dtypes and `requires_grad`
    only; tied parameters stay tied); buffers and other attributes are copied as they are."""
    memo = {id(param): nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            for param in model.parameters()}
    return copy.deepcopy(model, memo)


@torch.no_grad()
def fill_shards(sharded: nn.Module, model: nn.Module, device: torch.device, rank: int, ranks: int) -> None:
    """Allocate `sharded`'s parameters (FSDP2 shards on the meta device, from `meta_copy(model)`) on `device`
    and fill each with this rank's slice of `model`'s parameter of the same name, cast to the shard's dtype one
    slice at a time. FSDP2 shards dim 0 as `torch.chunk` cuts it over the `ranks` ranks (a rank past the last
    chunk holds an empty shard). The buffers keep their values."""
    buffers = {name: buffer.detach().clone() for name, buffer in sharded.named_buffers()}
    sharded.to_empty(device=device)  # FSDP2 re-registers its padded shard storage (`FSDPModule._apply`)
    for name, buffer in sharded.named_buffers():
        buffer.copy_(buffers[name])
    sources = dict(model.named_parameters())
    for name, param in sharded.named_parameters():
        local = param.to_local()
        if local.numel():
            local.copy_(torch.chunk(sources[name].detach(), ranks, dim=0)[rank])
