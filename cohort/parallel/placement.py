"""The run's placement: which ranks train and which sample, on which copy of the weights, and what is released
between phases, decided from the config alone, before any weight loads.
"""

from __future__ import annotations


def samples_in_place(args) -> bool:
    """Whether the run `args`' asynchronous rollouts sample on the engine's own copy, refreshed in place
    (cohort/rollout/async_rollouts.py): under FSDP2 without sampling ranks, one update behind (max_staleness None settles to 1
    there), and always on a colocated tensor-parallel group's shards (a larger max_staleness is refused)."""
    split = args.rollout_tensor_parallel_size
    return bool(args.async_rollouts and args.fsdp and not args.rollout_gpus
                and (args.max_staleness in (None, 1) or (isinstance(split, int) and split > 1)))


def producer_copy(args) -> bool:
    """Whether asynchronous rollouts keep a second copy of the policy for their producer thread: in one process
    or under DDP, yes; under FSDP2 they sample on the engine's own copy, one update behind (a tensor-parallel
    shard always; a whole copy with max_staleness 1), cohort/rollout/async_rollouts.py."""
    return bool(args.async_rollouts and not args.rollout_gpus and not samples_in_place(args))


def engine_released_in_update(args) -> bool:
    """Whether the run `args` frees the engine's weights between a rollout and the weight refresh that rewrites
    them (`Parallel.release_sampling_weights`): under FSDP2 with `free_sampling_memory`, synchronous (an
    asynchronous engine samples during the update), without LoRA (π_ref is that copy with its adapters off)."""
    return bool(args.fsdp and args.free_sampling_memory and not args.async_rollouts and not args.use_peft)
