"""The step log's lines on where rollouts are sampled and why, and on the engine's slots where a call has more
sequences than it decodes at once: the placement and the sampling plan, told to the user once at the start."""

from __future__ import annotations

from cohort_grpo.parallel.placement import Placement
from cohort_grpo.plans.sampling_plan import FILL, engine_call_rows, slot_length
from cohort_grpo.rollout.scheduler import ENGINE_SLOTS


def slots_line(args, placement: Placement, sampling_rank: bool = False) -> str | None:
    """The step log's line on the engine's slots where a GPU's call has more sequences than slots (None where
    every sequence of a call decodes at once, the plain case). `args`: the resolved config; `placement`: the run's,
    its split settled; `sampling_rank`: the line of a rank that only samples (`--rollout_gpus`), which sizes its
    own engine."""
    if not args.device.startswith("cuda") or (placement.rollout_gpus and not sampling_rank):
        return None  # the CPU's engine keeps its default; the sampling ranks' engines each say their own
    size = placement.split
    rows = engine_call_rows(args, placement, size if sampling_rank or placement.colocated else 1, sampling_rank)
    slots = args.max_concurrent_sequences
    if slots >= rows:
        return None
    beside = "" if sampling_rank else " and the training state"
    return (f"rollouts: the engine decodes at most {slots} of a call's {rows} sequences at once, the others wait for "
            f"a slot (max_concurrent_sequences; auto: as many KV caches of {slot_length(args)} tokens as fit beside "
            f"the weights{beside} in {FILL:.0%} of the GPU, at most {ENGINE_SLOTS}, at a CUDA-graph width)")


def placement_line(args, placement: Placement, asked_split, device) -> str | None:
    """The step log's lines on where rollouts are sampled and why, and on the engine's slots where a call has more
    sequences than that (`slots_line`); None where every rank samples a call at once on its own whole copy, the
    plain case. `placement`: the run's, its split settled; `asked_split`: rollout_tensor_parallel_size as the user
    gave it (`auto` or a number)."""
    lines = [line for line in (where_line(args, placement, asked_split, device), slots_line(args, placement)) if line]
    return "\n".join(lines) or None


def where_line(args, placement: Placement, asked_split, device) -> str | None:
    """`placement_line`'s line on where rollouts are sampled (None: each rank on its own whole copy)."""
    size, ranks = placement.split, placement.trainers
    why = ("auto: the smallest split that keeps the KV cache of a useful batch beside its weights" if asked_split == "auto"
           else "rollout_tensor_parallel_size")
    ahead = ("; asynchronous: the next step's rollout is sampled during the update, one update behind, and the "
             "copy refreshed once it is done") if placement.samples_in_place else ""
    if placement.colocated:
        return (f"rollouts: sampled on the {ranks} training ranks in {placement.groups} tensor-parallel group(s) of "
                f"{size}, each rank keeping its shard ({why}; colocated with FSDP2: the shards are refreshed from the "
                f"trained weights after each update{ahead})")
    if placement.fsdp_ranks_sample and asked_split == "auto" and device.type == "cuda":
        return (f"rollouts: each of the {ranks} FSDP2 ranks samples on a whole copy of the model (auto: one GPU "
                "holds its weights and the KV cache of a useful batch beside its training shard; "
                f"--rollout_tensor_parallel_size T samples in groups of T, each rank keeping 1/T{ahead})")
    if placement.rollout_gpus:
        return (f"rollouts: sampled on {placement.rollout_gpus} rank(s)"
                + (f" in {placement.groups} tensor-parallel group(s) of {size}" if size > 1 else
                   ", each holding the whole model") + f" ({why})"
                + f", max_staleness {args.max_staleness}" + (", partial rollouts" if args.partial_rollouts else ""))
    return None
