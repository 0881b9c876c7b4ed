"""Training ranks that sample together: one engine call for a tensor-parallel group's prompts.

In the colocated placement (cohort_grpo/parallel/colocation.py) each training rank holds one shard of the sampling
model, and the T ranks of a group run one engine over their shards: every rank of the group must make the same
engine calls, with the same prompts, or their collectives stop matching. Each rank still asks for its own
prompts, as with a whole model (`GroupSampler`, held-out evaluation). `ColocatedSampler` turns the group's T
requests into engine calls that every rank makes:

- requests that are blocks of one batch (the same settings, each rank's completions following the previous
  rank's: `sequence_offset`) are sampled in ONE call over all the group's prompts, and each rank keeps its block
  of the result. The engine keys each completion's noise by its index in the batch, so the tokens are those each
  rank's own call draws (the log-probs agree to float rounding);
- requests that are the same on every rank (held-out evaluation of the group's rows) are sampled once, and every
  rank keeps the whole result;
- anything else is sampled in T calls, one per rank's request, every rank making each call.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from cohort_grpo.errors import CohortError
from cohort_grpo.rollout.sampler import Rollout, Sampler, SamplingParams


class ColocatedSampler:
    """A `Sampler` over `sampler` (an engine over this rank's tensor-parallel shard) shared with the other ranks of
    `process_group`, which call `generate` as often as this rank does (see the module docstring)."""

    def __init__(self, sampler: Sampler, process_group):
        self.sampler, self.process_group = sampler, process_group
        self.rank, self.size = dist.get_rank(process_group), dist.get_world_size(process_group)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 turns=None) -> Rollout:
        if turns is not None:  # refused with the run's options before this (cohort_grpo/run/resolve.py)
            raise CohortError("multi-turn rollouts do not run in a tensor-parallel sampling group: every rank would "
                              "run the tools; use --rollout_tensor_parallel_size 1 for tool-using rollouts")
        requests = [None] * self.size
        dist.all_gather_object(requests, (prompt_ids, num_generations, params), group=self.process_group)
        if all(request == requests[0] for request in requests):
            return self.sampler.generate(prompt_ids, num_generations, params)
        if blocks_of_one_batch(requests):
            merged = self.sampler.generate([p for prompts, _, _ in requests for p in prompts], num_generations,
                                           requests[0][2])
            start = sum(len(prompts) for prompts, _, _ in requests[:self.rank]) * num_generations
            return merged.rows(start, start + len(prompt_ids) * num_generations)
        mine = None
        for rank, (prompts, generations, settings) in enumerate(requests):
            rollout = self.sampler.generate(prompts, generations, settings)
            mine = rollout if rank == self.rank else mine
        return mine

    def release(self) -> None:
        """Free the engine's KV cache and graphs (`--free_sampling_memory`); every rank's engine does the same."""
        if hasattr(self.sampler, "release"):
            self.sampler.release()

    def idle_buffers(self) -> list[torch.Tensor]:
        return list(getattr(self.sampler, "idle_buffers", lambda: [])())

    @property
    def stats(self) -> dict:
        return getattr(self.sampler, "stats", {})


def blocks_of_one_batch(requests: list[tuple[list, int, SamplingParams]]) -> bool:
    """Whether the ranks' (prompts, G, params) are consecutive blocks of one batch: the same G and settings, and
    each rank's first completion right after the previous rank's last (`sequence_offset`)."""
    first_prompts, generations, first = requests[0]
    expected = first.sequence_offset
    for prompts, count, params in requests:
        if count != generations or not prompts:
            return False
        if dataclasses.replace(params, sequence_offset=first.sequence_offset) != first:
            return False
        if params.sequence_offset != expected:
            return False
        expected += len(prompts) * generations
    return True

