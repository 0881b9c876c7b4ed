"""The colocated placement: every rank trains with FSDP2, then samples in tensor-parallel groups.

With `--fsdp`, no `--rollout_gpus` and `rollout_tensor_parallel_size` T > 1 (`Placement.colocated`), the W
training ranks form W / T groups of T consecutive ranks (`Placement.group_ranks`, `form_sampling_group`). Each
rank keeps, for sampling, only its T-way shard of the model (cohort_grpo/models/tensor_parallel.py;
`EngineCopy.sample_from_shard`) instead of a whole plain copy, and a group's ranks sample their prompts together,
in one engine call (cohort_grpo/rollout/colocated.py). No rank ever holds the whole model. What a rank holds, phase
by phase:

- sampling: its FSDP2 shards of the fp32 weights and of AdamW's moments (1/W each; no gradients, which the
  update frees after its optimizer step), its sampling shard (1/T of the weights, in the loaded dtype) and the
  engine's KV cache of its KV heads (1/T of the keys and values of the group's completions); π_ref, when
  β > 0, as a second FSDP2-sharded frozen copy (1/W, loaded dtype: `frozen_sharded_copy`).
- the log-prob passes (π_old through the FSDP2 policy, π_ref through its sharded copy) and the update: FSDP2
  gathers one decoder layer at a time. The engine's KV cache stays allocated for the next rollout (its CUDA
  graphs read it by address) unless `--free_sampling_memory` releases it and the graphs after each rollout
  (cohort_grpo/memory/manager.py); the one-process tricks do not apply here: the KV cache cannot lend its bytes to
  FSDP2's sharded gradients, and π_ref is sharded rather than offloaded to the host.
- the weight refresh after each update (`EngineCopy.refresh`): one FSDP2 parameter gathered at a
  time, in the sampling dtype, each rank copying its slice into its shard in place
  (cohort_grpo/models/resharding.py).
- checkpoints and the saved model: the policy and π_ref gathered from their FSDP2 shards into full state
  dicts on rank 0's host (`gathered_state`), loaded back on resume by every rank (`load_gathered_state`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
from torch import nn

from cohort_grpo.parallel.distributed import Parallel, shard_bounds
from cohort_grpo.parallel.engine_copy import EngineCopy
from cohort_grpo.parallel.placement import Placement


@dataclass(frozen=True)
class SamplingGroup:
    """A group of consecutive training ranks that share one engine over a tensor-parallel split of the model.

    ranks: their global ranks, the leader first; index: which of the `count` groups it is; process_group: the
    torch.distributed group its shard's collectives run in."""

    ranks: tuple[int, ...]
    index: int
    count: int
    process_group: object

    @property
    def leader(self) -> int:
        return self.ranks[0]

    def block(self, items: list) -> list:
        """This group's contiguous block of `items` (every rank of the group gets the same block)."""
        start, stop = shard_bounds(len(items), self.index, self.count)
        return items[start:stop]


def form_sampling_group(parallel: Parallel, placement: Placement, timeout_s: float) -> SamplingGroup:
    """This rank's group of `placement`'s settled split (a collective: every rank makes every group, in the same
    order, as torch.distributed requires). The split divides the training ranks (refused otherwise by `Placement`)."""
    import torch.distributed as dist

    mine = None
    for index in range(placement.groups):
        ranks = tuple(placement.group_ranks(index))
        made = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
        if parallel.rank in ranks:
            mine = SamplingGroup(ranks, index, placement.groups, made)
    return mine


def frozen_sharded_copy(parallel: Parallel, model: nn.Module) -> nn.Module:
    """π_ref as an FSDP2-sharded frozen copy of `model` (each rank 1/W of it, in `model`'s dtype), in eval
    mode: its log-prob pass gathers one layer at a time, as the policy's does, and no rank holds it whole."""
    ref = parallel.sharded_copy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def holds_shards(module: nn.Module) -> bool:
    """Whether `module`'s parameters are FSDP2 shards (DTensors) rather than whole tensors."""
    return any(hasattr(param, "full_tensor") for param in module.parameters())


def gathered_state(module: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole state dict of FSDP2-sharded `module` on rank 0's host (cast to `dtype`), empty on the other
    ranks: a collective every rank calls. Names are the unwrapped model's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: tensor if dtype is None else tensor.to(dtype) for name, tensor in state.items()}


def load_gathered_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Whole tensors `state` (every rank passes the same) into FSDP2-sharded `module`, each rank keeping its
    shard. A tied LM head stored once, under the embedding's name, is filled from it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    config = getattr(module, "config", None)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))


def colocate(parallel: Parallel, engine_copy: EngineCopy, placement: Placement, timeout_s: float,
             reference: bool) -> tuple[nn.Module, nn.Module | None]:
    """After `parallel.wrap(model, fsdp=True)`, for a colocated `placement` (its split settled): this rank's
    sampling group is formed (a collective), π_ref made as a sharded frozen copy of the whole copy
    `engine_copy.model` when `reference`, and that copy replaced, for the engine, by this rank's shard (the whole
    copy is left on the meta device). Returns (the shard, π_ref or None)."""
    ref = frozen_sharded_copy(parallel, engine_copy.model) if reference else None  # before the whole copy goes
    parallel.sampling_group = form_sampling_group(parallel, placement, timeout_s)
    return engine_copy.sample_from_shard(parallel.sampling_group.process_group), ref
