"""The trainer's weights into a tensor-parallel sampling shard, in place, one full tensor at a time.

After each update, every rank's shard of the sampling model (cohort_grpo/models/tensor_parallel.py; the
Megatron-LM split, Shoeybi et al. 2019) must hold the new weights. The trainer holds them whole (one
process, DDP) or sharded by FSDP2 (`fully_shard`: each rank 1/N of every parameter, as a DTensor).
Building a full state dict first would hold a second whole model on every rank; instead:

- `full_parameters(model)` yields (name, full tensor) one parameter at a time: an FSDP2 parameter is
  gathered (`DTensor.full_tensor`, an all-gather over the FSDP group) only when the consumer asks for
  it, and its reference is dropped before the next gather; a plain parameter is yielded as it is.
- `update_shard_(shard, items)` copies each tensor's slice for this rank (`rank_slice`, the same rule
  that built the shard) into the shard's existing parameter with `copy_`, and drops the full tensor
  before asking for the next.

Together a rank holds its shard plus at most one gathered parameter (the largest is the embedding or
the LM head, V × hidden). The copies are in place: the shard's tensors keep their addresses, which a
CUDA-graph engine captured, and q/k/v and gate/up fused by `fuse_projections` (cohort_grpo/models/fusion.py)
stay views of their fused buffers, so the fused matrices a no-grad forward reads are updated too.

Gathering is a collective: every rank of the FSDP group must run the generator to its end, in the same
parameter order (they do, holding the same model). A refusal (an unknown name, a shape that does not
fit) comes from the weights of the model, so every rank meets it at the same parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from cohort_grpo.errors import CohortError
from cohort_grpo.models.tensor_parallel import EXPERTS_GATE_UP, VOCABULARY_PARALLEL, rank_slice

# Module names that wrappers insert in parameter names: torch.compile, activation checkpointing, FSDP1.
# FSDP2 (fully_shard) keeps the plain names; DDP puts "module." in front.
WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def plain_parameter_name(name: str) -> str:
    """`name` without the parts wrappers add (see WRAPPER_PARTS; DDP's leading "module."): the name the
    unwrapped model, and so a shard of it, gives the same parameter."""
    parts = [part for part in name.split(".") if part not in WRAPPER_PARTS]
    if parts[:1] == ["module"] and len(parts) > 1:
        parts = parts[1:]
    return ".".join(parts)


def full_parameters(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain name, whole tensor) of each parameter of `model`, one at a time: an FSDP2 parameter (a
    DTensor) gathered when asked for, a plain one as it is (detached, no copy). `dtype`: cast before the
    gather (a bf16 sampler then gathers half the bytes of fp32 masters). Tied weights come once, under
    the first name (named_parameters' order). Under FSDP2 every rank of the group must exhaust it."""
    for name, param in model.named_parameters():
        tensor = param.detach()
        if dtype is not None:
            tensor = tensor.to(dtype)
        if hasattr(tensor, "full_tensor"):  # FSDP2: a DTensor over the ranks' shards
            tensor = tensor.full_tensor()
        yield plain_parameter_name(name), tensor
        del tensor  # before the next gather: at most one gathered parameter alive here


@torch.no_grad()
def update_shard_(shard: nn.Module, items: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> nn.Module:
    """Copy, in place, this rank's slice of each (name, full tensor) of `items` into `shard`: a
    `TensorParallelCausalLM` (its rank's slice, `rank_slice`) or a plain `CausalLM` (the whole tensor).
    Names are the full model's (its state_dict's, or `full_parameters`'); dtype and device are cast to
    the shard's. `items` is consumed one pair at a time and each full tensor released before the next,
    so a generator keeps at most one full tensor alive beyond the shard. A tied shard's embedding and
    head are one tensor: either name updates both. Padded vocabulary rows keep their values (never read).

    Refused, as one CohortError line naming the tensor: a name the shard does not have, a tensor whose
    slice does not fit its place; with `strict`, a parameter `items` did not update. A refusal stops
    midway, leaving the shard partly updated: fix the weights and update it again. Returns `shard`."""
    config = getattr(shard, "full_config", None) or shard.config
    rank, size = getattr(shard, "tensor_parallel_rank", 0), getattr(shard, "tensor_parallel_size", 1)
    targets = dict(shard.named_parameters(remove_duplicate=False))  # tied: both names, one tensor
    written = set()
    for name, full in items:
        target = targets.get(name)
        if target is None:
            raise CohortError(f"the weight {name} has no place in this {config.model_type} shard; pass the "
                              "full model's parameter names (its state_dict's, without wrappers' prefixes)")
        piece = rank_slice(name, full, config, rank, size)
        # a vocabulary slice's real rows: the last slices may be shorter than the shard's padded rows
        destination = target[:piece.shape[0]] if name in VOCABULARY_PARALLEL else target
        if name.endswith(EXPERTS_GATE_UP) and destination.dim() == 3 and piece.dim() == 4:
            destination = destination.unflatten(1, (2, -1))  # the shard's [E, 2I/T, H] as its gate and up halves
        if piece.shape != destination.shape:
            raise CohortError(f"the weight {name} has shape {tuple(full.shape)}, whose rank-{rank} slice "
                              f"{tuple(piece.shape)} does not fit the shard's {tuple(destination.shape)}; pass "
                              "the weights of the model the shard was built from")
        destination.copy_(piece)  # into the existing storage: captured graphs and fused views see it
        written.add(id(target))
        del full, piece, destination  # the caller's generator may gather the next one now
    if strict:
        missing = [name for name, target in targets.items() if id(target) not in written]
        if missing:
            raise CohortError(f"{len(missing)} weight(s) of the shard were not updated ({', '.join(missing[:3])}"
                              f"{', ...' if len(missing) > 3 else ''}); pass every parameter of the full model")
    return shard
