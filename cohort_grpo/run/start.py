"""A rank's start-up, the same on the ranks that train (`assemble_run`) and on those that only sample
(`SamplingRank`, `--rollout_gpus`): seeds and determinism, the ranks joined, the policy loaded, the run's
configuration resolved and the rollout link sized for it.

Both kinds of rank settle the configuration from the same model and tools (cohort_grpo/run/resolve.py), so they agree on
`partial_rollouts`, `max_staleness` and the sampling split without a message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.models.tiny import run_device
from cohort_grpo.parallel.distributed import Parallel
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.run.determinism import prepare_full_determinism, seed_everything
from cohort_grpo.run.policy import load_run_policy
from cohort_grpo.run.resolve import resolve_run_config
from cohort_grpo.tools.toolbox import Toolbox


@dataclass
class RankStart:
    """What a rank starts from. args: the run's resolved, frozen configuration; parallel: this rank's place among
    the ranks (for a sampling rank, that rank alone, with the link to its trainers); model, tokenizer, pad_id: the
    policy as `load_run_policy` loaded it; placement: the run's, its sampling split settled."""

    args: GRPOConfig
    parallel: Parallel
    model: nn.Module
    tokenizer: Any
    pad_id: int
    placement: Placement

    @property
    def device(self) -> torch.device:
        return self.parallel.device


def start_rank(model, args: GRPOConfig, processing_class=None, *, placement: Placement, toolbox: Toolbox | None,
               peft_config=None, log: Callable[[str], None] = print, sampling_rank: bool = False,
               before_loading: Callable[[GRPOConfig, Parallel], GRPOConfig] | None = None) -> RankStart:
    """This rank of the run `args` (validated, not yet resolved) describes, started: seeded (and made fully
    deterministic when asked, before the first CUDA work), joined to the other ranks (torchrun's; with
    --rollout_gpus the last ones only sample), its policy loaded (the trainers' dtype and LoRA adapters, so the
    weights rank 0 broadcasts fit a sampling rank's copy too), the configuration resolved and frozen.

    placement: the run's (`Placement.from_config`, decided before anything starts); toolbox: the tools a completion may call (the resolution refuses what they cannot run with); sampling_rank:
    this rank only samples. before_loading(args, parallel): what a trainer rank settles once the ranks are joined
    and before the weights load (whether the run fits, the steps of its epochs); it returns the config to resolve."""
    seed_everything(args.seed)
    if args.full_determinism:
        prepare_full_determinism()  # before the first CUDA work
    # torchrun's ranks (cohort_grpo/parallel/distributed.py): the same process groups on trainer and sampling ranks.
    parallel = Parallel.from_env(run_device(args.device, model), args.ddp_timeout, placement)
    if before_loading is not None:
        args = before_loading(args, parallel)
    model, tokenizer, pad_id = load_run_policy(model, processing_class, args, parallel.device,
                                               peft_config=peft_config, log=log)
    # The run's configuration, settled once, frozen; everything built after this reads it (cohort_grpo/run/resolve.py).
    args = resolve_run_config(args, model=model, device=parallel.device, placement=placement,
                              tools=toolbox is not None, sampling_rank=sampling_rank)
    placement = placement.settled(args.rollout_tensor_parallel_size)
    if parallel.link is not None:  # the rollout link's message window covers the resolved staleness
        parallel.link.cover_staleness(args.max_staleness)
        parallel.link.form_sampling_groups(placement)
    return RankStart(args=args, parallel=parallel, model=model, tokenizer=tokenizer, pad_id=pad_id,
                     placement=placement)
