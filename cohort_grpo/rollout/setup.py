"""The rollout side of a run, built from its options: what a trainer rank samples with, or what a sampling
rank (`--rollout_gpus`) serves.

A trainer rank gets its sampler over the live policy and the `GroupSampler` stage over it, plus, with
`--async_rollouts`, the rollouts sampled ahead: on a producer thread over a copy of the policy
(`AsyncRollouts`), or by its sampling rank (`RemoteRollouts`) — `build_rollouts`; and, once the run's other
stages exist, the one `RolloutSource` the trainer takes each step's rollout from (cohort_grpo/rollout/source.py) —
`rollout_source`. A sampling rank gets the `RolloutServer` it runs until its trainers stop —
`build_rollout_server` (cohort_grpo/run/sampling_rank.py runs it). Both read `partial_rollouts` and `max_staleness`
from the run's resolved config (`cohort_grpo.run.resolve`), settled from the same model and tools on every rank, so
the ranks agree without a message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cohort_grpo.errors import CohortError
from cohort_grpo.models.policy import frozen_copy
from cohort_grpo.tools.toolbox import Toolbox
from cohort_grpo.rollout import make_sampler
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.rollout.async_rollouts import AsyncRollouts
from cohort_grpo.rollout.colocated import ColocatedSampler
from cohort_grpo.rollout.engine import Engine
from cohort_grpo.rollout.group_sampler import GroupSampler
from cohort_grpo.rollout.images import ImagePrompts
from cohort_grpo.rollout.partial import partial_rollouts
from cohort_grpo.rollout.remote import RemoteRollouts, RolloutServer
from cohort_grpo.rollout.sampler import Sampler
from cohort_grpo.rollout.source import RolloutSource, SampledAhead, SampleNow


@dataclass
class Rollouts:
    """What a trainer rank samples with.

    sampler: the engine (or Hugging Face `generate`) over the policy itself; group_sampler: Algorithm 1's
    sampling stage over it. ahead: the rollouts sampled ahead (`AsyncRollouts` or `RemoteRollouts`), None when
    each step samples its own; ahead_sampler: the engine that samples them on this rank (None: sampling ranks do).
    sequence_offset: the global index of this rank's first completion in a step's batch, which keys its
    sampling noise, so that several ranks draw what one would."""

    sampler: Sampler
    group_sampler: GroupSampler
    ahead: AsyncRollouts | RemoteRollouts | None = None
    ahead_sampler: Sampler | None = None
    sequence_offset: int = 0


def build_rollouts(args, model, tokenizer, pad_id: int, toolbox: Toolbox | None = None, *, placement: Placement,
                   link=None, rank: int = 0, sampler_factory: Callable[..., Sampler] | None = None,
                   sampling_group=None) -> Rollouts:
    """The rollout side of trainer rank `rank` of the run `args` describes.

    model: the policy the sampler reads (under FSDP, the full copy, or this rank's tensor-parallel shard); pad_id:
    the padding token id; toolbox: the tools a completion may call. placement: the run's, its split settled (which
    copy samples ahead: `Placement.async_mode`). link: the job's `RolloutLink` with
    --rollout_gpus, else None. sampling_group: the process group of the training ranks that sample together over
    their shards (the colocated placement), else None.
    sampler_factory(model, tokenizer): makes each sampler (default `make_sampler`; a benchmark passes its own
    engine). `args` is the run's resolved config: `partial_rollouts` and `max_staleness` are settled there."""
    sampler_factory = capped(sampler_factory or make_sampler, args.max_concurrent_sequences)
    sampler = sampler_factory(model, tokenizer)
    if sampling_group is not None:  # the group's requests become engine calls every rank of it makes
        sampler = ColocatedSampler(sampler, sampling_group)
    images = ImagePrompts.of(model, args.chat_template_kwargs)  # a vision-language model's prompt renderer
    if images is not None:
        refuse_with_images(args, toolbox, link, sampling_group)
    group_sampler = GroupSampler(sampler, tokenizer, args, pad_id, toolbox, images=images)
    ahead = ahead_sampler = None
    if args.async_rollouts:
        if toolbox is not None and toolbox.environment_factory is not None:
            raise CohortError("async_rollouts with an environment_factory is not supported (an environment's "
                              "state cannot be checkpointed with the rollouts sampled ahead); leave one out")
        if link is not None:  # --rollout_gpus: sampled on other ranks
            ahead = RemoteRollouts(link, rank, args.max_staleness, partial=args.partial_rollouts)
        elif placement.samples_in_place:
            # a producer thread samples later steps on the engine's own copy (the whole model or this rank's
            # shard), which the trainer refreshes in place between its rollouts
            ahead_sampler = sampler
            ahead = AsyncRollouts(None, GroupSampler(sampler, tokenizer, args, pad_id, toolbox, images=images),
                                  args.max_staleness)
        else:  # a producer thread samples later steps on its own copy of the policy
            sampler_policy = frozen_copy(model)
            ahead_sampler = sampler_factory(sampler_policy, tokenizer)
            ahead = AsyncRollouts(sampler_policy, GroupSampler(ahead_sampler, tokenizer, args, pad_id, toolbox,
                                                               images=images), args.max_staleness)
    return Rollouts(sampler, group_sampler, ahead=ahead, ahead_sampler=ahead_sampler,
                    sequence_offset=args.prompts_per_step * rank * args.num_generations)


def refuse_with_images(args, toolbox: Toolbox | None, link, sampling_group) -> None:
    """What a vision-language run cannot do yet, refused by name in one line."""
    if toolbox is not None:
        raise CohortError("tool turns with images are not supported yet: drop tools / environment_factory for a "
                          "vision-language model")
    if link is not None or sampling_group is not None:
        raise CohortError("a vision-language model samples on the training ranks only for now: drop --rollout_gpus "
                          "and the colocated sampling placement")


def rollout_source(rollouts: Rollouts, *, memory, phases, next_rows, next_seed, engine_copy, policy, parallel,
                   max_steps: int, past_end: bool = True, log=print) -> RolloutSource:
    """The `RolloutSource` a trainer rank takes each step's rollout from, over what `build_rollouts` made:
    `SampleNow`, or with rollouts sampled ahead `SampledAhead` (the arguments are theirs, cohort_grpo/rollout/source.py)."""
    now = SampleNow(rollouts.group_sampler, memory=memory, phases=phases, next_rows=next_rows, next_seed=next_seed,
                    sequence_offset=rollouts.sequence_offset, engine_copy=engine_copy)
    if rollouts.ahead is None:
        return now
    return SampledAhead(rollouts.ahead, now, policy=policy, parallel=parallel, max_steps=max_steps,
                        sampler=rollouts.ahead_sampler, past_end=past_end, log=log)


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
