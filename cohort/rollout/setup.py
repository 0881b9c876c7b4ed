"""The rollout side of a run, built from its options: what a trainer rank samples with, or what a sampling
rank (`--rollout_gpus`) serves.

A trainer rank gets its sampler over the live policy and the `GroupSampler` stage over it, plus, with
`--async_rollouts`, the rollouts sampled ahead: on a producer thread over a copy of the policy
(`AsyncRollouts`), or by its sampling rank (`RemoteRollouts`) — `build_rollouts`. A sampling rank gets the
`RolloutServer` it runs until its trainers stop — `build_rollout_server` (cohort/rollout/sampling_rank.py runs
it). Both read `partial_rollouts` and `max_staleness` from the run's resolved config (`cohort.resolve`),
settled from the same model and tools on every rank, so the ranks agree without a message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import CohortError
from ..memory.sampling_plan import FILL, engine_call_rows, slot_length
from ..models.policy import frozen_copy
from ..tools.toolbox import Toolbox
from . import make_sampler
from .async_rollouts import AsyncRollouts, samples_in_place
from .colocated import ColocatedSampler
from .engine import Engine
from .group_sampler import GroupSampler
from .partial import partial_rollouts
from .remote import RemoteRollouts, RolloutServer
from .scheduler import ENGINE_SLOTS
from .sampler import Sampler


@dataclass
class Rollouts:
    """What a trainer rank samples with.

    sampler: the engine (or Hugging Face `generate`) over the policy itself; group_sampler: Algorithm 1's
    sampling stage over it. async_rollouts: the rollouts sampled ahead (`AsyncRollouts` or `RemoteRollouts`),
    None when each step samples its own.
    sequence_offset: the global index of this rank's first completion in a step's batch, which keys its
    sampling noise, so that several ranks draw what one would."""

    sampler: Sampler
    group_sampler: GroupSampler
    async_rollouts: AsyncRollouts | RemoteRollouts | None = None
    sequence_offset: int = 0


def build_rollouts(args, model, tokenizer, pad_id: int, toolbox: Toolbox | None = None, *, link=None, rank: int = 0,
                   sampler_factory: Callable[..., Sampler] | None = None, sampling_group=None) -> Rollouts:
    """The rollout side of trainer rank `rank` of the run `args` describes.

    model: the policy the sampler reads (under FSDP, the full copy, or this rank's tensor-parallel shard); pad_id:
    the padding token id; toolbox: the tools a completion may call. link: the job's `RolloutLink` with
    --rollout_gpus, else None. sampling_group: the process group of the training ranks that sample together over
    their shards (the colocated placement), else None.
    sampler_factory(model, tokenizer): makes each sampler (default `make_sampler`; a benchmark passes its own
    engine). `args` is the run's resolved config: `partial_rollouts` and `max_staleness` are settled there."""
    sampler_factory = capped(sampler_factory or make_sampler, args.max_concurrent_sequences)
    sampler = sampler_factory(model, tokenizer)
    if sampling_group is not None:  # the group's requests become engine calls every rank of it makes
        sampler = ColocatedSampler(sampler, sampling_group)
    group_sampler = GroupSampler(sampler, tokenizer, args, pad_id, toolbox)
    ahead = None
    if args.async_rollouts:
        if toolbox is not None and toolbox.environment_factory is not None:
            raise CohortError("async_rollouts with an environment_factory is not supported (an environment's "
                              "state cannot be checkpointed with the rollouts sampled ahead); leave one out")
        if link is not None:  # --rollout_gpus: sampled on other ranks
            ahead = RemoteRollouts(link, rank, args.max_staleness, partial=args.partial_rollouts)
        elif samples_in_place(args):
            # a producer thread samples later steps on the engine's own copy (the whole model or this rank's
            # shard), which the trainer refreshes in place between its rollouts
            ahead = AsyncRollouts(None, GroupSampler(sampler, tokenizer, args, pad_id, toolbox), args.max_staleness)
        else:  # a producer thread samples later steps on its own copy of the policy
            sampler_policy = frozen_copy(model)
            ahead = AsyncRollouts(sampler_policy, GroupSampler(
                sampler_factory(sampler_policy, tokenizer), tokenizer, args, pad_id, toolbox), args.max_staleness)
    return Rollouts(sampler, group_sampler, async_rollouts=ahead,
                    sequence_offset=args.prompts_per_step * rank * args.num_generations)


def build_rollout_server(args, model, tokenizer, pad_id: int, toolbox: Toolbox | None, link,
                         sampler_factory: Callable[..., Sampler] | None = None, shard_layout=None) -> RolloutServer:
    """A sampling rank's `RolloutServer` for the trainers `link` connects it to; the arguments are
    `build_rollouts`'s. shard_layout: with a tensor-parallel shard as `model`, the whole model's tensors
    (`split_for_sampling`), which rank 0's weight broadcast sends."""
    sampler = capped(sampler_factory or make_sampler, args.max_concurrent_sequences)(model, tokenizer)
    group_sampler = GroupSampler(sampler, tokenizer, args, pad_id, toolbox)
    # One engine call per step for all the trainers served: our engine's noise is keyed by each
    # completion's index in the step's batch, so merged calls draw what separate ones would.
    return RolloutServer(link, model, group_sampler, group_size=args.num_generations,
                         merge_requests=isinstance(sampler, Engine) and toolbox is None,
                         partial=partial_rollouts(args, sampler, group_sampler, pad_id), shard_layout=shard_layout)


def capped(sampler_factory: Callable[..., Sampler], slots: int) -> Callable[..., Sampler]:
    """`sampler_factory` whose engines decode at most `slots` sequences at once (the run's resolved
    `max_concurrent_sequences`); an engine made with fewer keeps its own, and other samplers are left as made."""
    def make(model, tokenizer):
        sampler = sampler_factory(model, tokenizer)
        if isinstance(sampler, Engine):
            sampler.max_batch_size = min(sampler.max_batch_size, slots)
        return sampler
    return make


def slots_line(args, sampling_rank: bool = False) -> str | None:
    """The step log's line on the engine's slots where a GPU's call has more sequences than slots (None where
    every sequence of a call decodes at once, the plain case). `args`: the resolved config; `sampling_rank`: the
    line of a rank that only samples (`--rollout_gpus`), which sizes its own engine."""
    if not args.device.startswith("cuda") or (args.rollout_gpus and not sampling_rank):
        return None  # the CPU's engine keeps its default; the sampling ranks' engines each say their own
    size = args.rollout_tensor_parallel_size
    colocated = args.fsdp and not args.rollout_gpus and size > 1
    rows = engine_call_rows(args, size if sampling_rank or colocated else 1, sampling_rank)
    slots = args.max_concurrent_sequences
    if slots >= rows:
        return None
    beside = "" if sampling_rank else " and the training state"
    return (f"rollouts: the engine decodes at most {slots} of a call's {rows} sequences at once, the others wait for "
            f"a slot (max_concurrent_sequences; auto: as many KV caches of {slot_length(args)} tokens as fit beside "
            f"the weights{beside} in {FILL:.0%} of the GPU, at most {ENGINE_SLOTS}, at a CUDA-graph width)")


def placement_line(args, asked_split, world_size: int, group, device) -> str | None:
    """The step log's lines on where rollouts are sampled and why, and on the engine's slots where a call has more
    sequences than that (`slots_line`); None where every rank samples a call at once on its own whole copy, the
    plain case. `asked_split`: rollout_tensor_parallel_size as the user gave it (`auto` or a number); `group`:
    this rank's colocated sampling group, if any."""
    lines = [line for line in (where_line(args, asked_split, world_size, group, device), slots_line(args)) if line]
    return "\n".join(lines) or None


def where_line(args, asked_split, world_size: int, group, device) -> str | None:
    """`placement_line`'s line on where rollouts are sampled (None: each rank on its own whole copy)."""
    size = args.rollout_tensor_parallel_size
    why = ("auto: the smallest split that keeps the KV cache of a useful batch beside its weights" if asked_split == "auto"
           else "rollout_tensor_parallel_size")
    ahead = ("; asynchronous: the next step's rollout is sampled during the update, one update behind, and the "
             "copy refreshed once it is done") if samples_in_place(args) else ""
    if group is not None:
        return (f"rollouts: sampled on the {world_size} training ranks in {group.count} tensor-parallel group(s) of "
                f"{size}, each rank keeping its shard ({why}; colocated with FSDP2: the shards are refreshed from the "
                f"trained weights after each update{ahead})")
    if args.fsdp and asked_split == "auto" and world_size > 1 and device.type == "cuda":
        return (f"rollouts: each of the {world_size} FSDP2 ranks samples on a whole copy of the model (auto: one GPU "
                "holds its weights and the KV cache of a useful batch beside its training shard; "
                f"--rollout_tensor_parallel_size T samples in groups of T, each rank keeping 1/T{ahead})")
    if args.rollout_gpus:
        return (f"rollouts: sampled on {args.rollout_gpus} rank(s)"
                + (f" in {args.rollout_gpus // size} tensor-parallel group(s) of {size}" if size > 1 else
                   ", each holding the whole model") + f" ({why})"
                + f", max_staleness {args.max_staleness}" + (", partial rollouts" if args.partial_rollouts else ""))
    return None
