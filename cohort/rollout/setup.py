"""The rollout side of a run, built from its options: what a trainer rank samples with, or what a sampling
rank (`--rollout_gpus`) serves.

A trainer rank gets its sampler over the live policy and the `GroupSampler` stage over it, plus, with
`--async_rollouts`, the rollouts sampled ahead: on a producer thread over a copy of the policy
(`AsyncRollouts`), or by its sampling rank (`RemoteRollouts`). A sampling rank gets the `RolloutServer` it
runs until its trainers stop (`serve_rollouts`). Both read `partial_rollouts` and `max_staleness` from the run's
resolved config, settled from the same model and tools on every rank, so the ranks agree without a message.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, ContextManager

from ..errors import CohortError
from ..models.policy import frozen_copy
from ..run.lifecycle import StopRequest
from ..tools.toolbox import Toolbox
from . import make_sampler as default_make_sampler
from .async_rollouts import AsyncRollouts
from .engine import Engine
from .group_sampler import GroupSampler
from .partial import partial_rollouts
from .remote import RemoteRollouts, RolloutServer
from .sampler import Sampler


@dataclass
class Rollouts:
    """What a rank samples with.

    sampler: the engine (or Hugging Face `generate`) over the policy itself; group_sampler: Algorithm 1's
    sampling stage over it. async_rollouts: the rollouts sampled ahead (`AsyncRollouts` or `RemoteRollouts`),
    None when each step samples its own. server: a sampling rank's `RolloutServer`, None on a trainer rank.
    sequence_offset: the global index of this rank's first completion in a step's batch, which keys its
    sampling noise, so that several ranks draw what one would."""

    sampler: Sampler
    group_sampler: GroupSampler
    async_rollouts: AsyncRollouts | RemoteRollouts | None = None
    server: RolloutServer | None = None
    sequence_offset: int = 0


def build_rollouts(args, model, tokenizer, pad_id: int, toolbox: Toolbox | None = None, *, link=None, rank: int = 0,
                   serve: bool = False, make_sampler: Callable[..., Sampler] = default_make_sampler) -> Rollouts:
    """The rollout side of one rank of the run `args` describes.

    model: the policy the sampler reads (under FSDP, the full copy); pad_id: the padding token id; toolbox: the
    tools a completion may call. link: the job's `RolloutLink` with --rollout_gpus, else None; rank: this rank's
    global rank. serve: this rank only samples, for the trainers `link` connects it to. make_sampler(model,
    tokenizer): makes each sampler; the trainer passes the name in its own module, which a benchmark replaces
    to inject its engine. `args` is the run's resolved config (`cohort.resolve`): `partial_rollouts` and
    `max_staleness` are settled there."""
    sampler = make_sampler(model, tokenizer)
    group_sampler = GroupSampler(sampler, tokenizer, args, pad_id, toolbox)
    if serve:
        # One engine call per step for all the trainers served: our engine's noise is keyed by each
        # completion's index in the step's batch, so merged calls draw what separate ones would.
        server = RolloutServer(link, model, group_sampler, group_size=args.num_generations,
                               merge_requests=isinstance(sampler, Engine) and toolbox is None,
                               partial=partial_rollouts(args, sampler, group_sampler, pad_id))
        return Rollouts(sampler, group_sampler, server=server)
    ahead = None
    if args.async_rollouts:
        if toolbox is not None and toolbox.environment_factory is not None:
            raise CohortError("async_rollouts with an environment_factory is not supported (an environment's "
                              "state cannot be checkpointed with the rollouts sampled ahead); leave one out")
        if link is not None:  # --rollout_gpus: sampled on other ranks
            ahead = RemoteRollouts(link, rank, args.max_staleness, partial=args.partial_rollouts)
        else:  # a producer thread samples later steps on its own copy of the policy
            sampler_policy = frozen_copy(model)
            ahead = AsyncRollouts(sampler_policy, GroupSampler(
                make_sampler(sampler_policy, tokenizer), tokenizer, args, pad_id, toolbox), args.max_staleness)
    return Rollouts(sampler, group_sampler, async_rollouts=ahead,
                    sequence_offset=args.prompts_per_step * rank * args.num_generations)


def serve_rollouts(server: RolloutServer, parallel, deterministic: ContextManager) -> int:
    """A sampling rank's whole run: serve its trainers (inside `deterministic`) until they stop, then leave the
    job; the number of rollouts sampled."""
    # SIGINT / SIGTERM reach every rank: the trainers finish their step and save, which needs this rank's
    # rollouts, so a first signal is noted and serving goes on until they stop (a second one stops it).
    stop = StopRequest()
    stop.install()
    try:
        with deterministic:
            served = server.serve()
    finally:
        stop.uninstall()
    parallel.close()
    print(f"cohort: rank {parallel.rank} sampled {served} rollouts for trainer rank(s) "
          f"{', '.join(map(str, server.trainers))}", file=sys.stderr, flush=True)
    return served
