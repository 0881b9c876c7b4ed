"""The engine's copy of the policy under FSDP2: the weights it samples, refreshed from the trained shards.

FSDP2 trains a sharded copy of the policy (cohort_grpo/parallel/sharding.py); the engine cannot sample from shards
(it would all-gather every layer at every decode step), so each rank keeps whole weights of its own for it: a
plain copy of the model in the loaded dtype, or, in the colocated placement, this rank's tensor-parallel shard
(cohort_grpo/parallel/colocation.py). `EngineCopy` holds that pair. After each update it gathers the trained weights
into the engine's copy (`refresh`: one all-gather of the weights a step, a collective every rank makes at the
same point); where the run frees the engine's weights between a rollout and that refresh
(`engine_released_in_update`), it hands their memory to the update and takes it back (`release`).

This is not a collective of the step's data parallelism (those are `Parallel`'s): the rollout source that
samples from the copy owns it (cohort_grpo/rollout/source.py), and a resumed run's checkpoint refreshes it once the
trained weights are loaded (cohort_grpo/run/checkpoint_load.py).
"""

from __future__ import annotations

import torch
from torch import nn

from cohort_grpo.models.resharding import full_parameters, update_shard_
from cohort_grpo.models.tensor_parallel import TensorParallelCausalLM, shard_model


class EngineCopy:
    """What the engine samples under FSDP2 (`model`: the plain copy, or this rank's tensor-parallel shard after
    `sample_from_shard`) and the FSDP2-sharded copy the update trains (`trained`), which it is refreshed from."""

    def __init__(self, model: nn.Module, trained: nn.Module):
        self.model, self.trained = model, trained
        self.released: list[tuple[nn.Parameter, torch.Size]] = []  # `release`: each parameter and its shape

    def sample_from_shard(self, group) -> nn.Module:
        """The colocated placement: this rank's shard of the plain copy over its sampling `group` becomes what the
        engine samples and `refresh` updates, and the whole plain copy's memory goes (it is left on the meta
        device). Returns the shard."""
        shard = shard_model(self.model, group)
        self.model.to("meta")
        self.model = shard
        return shard

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the trained weights, gathered, into the engine's copy (in place, so the engine's captured graphs
        stay valid), cast to its dtype before the gather to halve the traffic; into a tensor-parallel shard, one
        gathered parameter at a time, each rank copying its slice (cohort_grpo/models/resharding.py). Every rank must
        call it at the same point."""
        for param, shape in self.released:  # the same parameters, their memory back (new addresses)
            param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
        self.released = []
        if isinstance(self.model, TensorParallelCausalLM):
            update_shard_(self.model, full_parameters(self.trained, dtype=self.model.dtype))
            return
        targets = dict(self.model.named_parameters())
        for name, param in self.trained.named_parameters():
            target = targets[name]
            target.copy_(param.detach().to(target.dtype).full_tensor())

    def release(self) -> None:
        """After a rollout: the memory of the engine's weights goes to the log-prob passes and the update; `refresh`
        allocates it again before it copies the updated weights in, so nothing reads them in between. The
        engine's graphs, which read the weights by address, must have been released with them
        (`MemoryManager.after_sampling`)."""
        if self.released:
            return
        for param in self.model.parameters():
            self.released.append((param, param.shape))
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
