"""A rank of a torchrun job that only samples, for the ranks that train (`--rollout_gpus K`: the last K ranks).

It holds no training state: it loads the policy as the trainers do (the same dtype and LoRA adapters, so the
weights rank 0 broadcasts after each update fit its copy), builds its `RolloutServer` (cohort_grpo/rollout/remote.py)
and serves its trainers' requests until they stop. `cohort-grpo train` starts one on those ranks itself; a torchrun
script of your own does it with

    if is_sampling_rank(args):
        SamplingRank(model, args, processing_class=tokenizer).serve()
    else:
        GRPOTrainer(model, reward_funcs, train_dataset, args=args, processing_class=tokenizer).train()
"""

from __future__ import annotations

import sys
from typing import Callable

from cohort_grpo.run.determinism import run_determinism
from cohort_grpo.errors import CohortError
from cohort_grpo.models.tensor_parallel import check_splittable, shard_model
from cohort_grpo.parallel.placement import Placement, launched_rank, launched_world_size
from cohort_grpo.run.lifecycle import StopRequest
from cohort_grpo.run.start import start_rank
from cohort_grpo.tools.toolbox import make_toolbox
from cohort_grpo.rollout.sampler import Sampler
from cohort_grpo.plans.placement_lines import slots_line
from cohort_grpo.rollout.setup import build_rollout_server


def split_for_sampling(model, group, args, tools: bool):
    """(this rank's tensor-parallel shard of `model`, the whole model's tensors as (name, shape, dtype) in
    state-dict order: the layout of rank 0's weight broadcast). Refused, in one line, where the split
    cannot work (`check_splittable`: a model sampled through Hugging Face `generate`, LoRA, tools)."""
    check_splittable(model, args.rollout_tensor_parallel_size, tools)
    layout = [(name, tensor.shape, tensor.dtype) for name, tensor in model.state_dict().items()]
    shard = shard_model(model, group)
    model.to("meta")  # the whole copy's memory goes before the engine takes its KV cache
    return shard, layout


def is_sampling_rank(args) -> bool:
    """Whether this process (torchrun's RANK among WORLD_SIZE) is one of the last `args.rollout_gpus` ranks,
    which run a `SamplingRank` instead of a `GRPOTrainer` (a placement that cannot run is refused here)."""
    return Placement.from_config(args.validate(), launched_world_size()).samples_here(launched_rank())


class SamplingRank:
    """This rank's sampling side of a `--rollout_gpus` job: built from the trainers' own arguments (those a
    sampling rank needs: the model, its tokenizer, the config, the tools and LoRA settings), then `serve()`.

    sampler_factory(model, tokenizer): makes the sampler (default `cohort_grpo.rollout.make_sampler`), as given to
    `GRPOTrainer`. After construction: `server` (the `RolloutServer`), `sampler` (its engine), `parallel`."""

    def __init__(self, model, args, processing_class=None, *, task=None, tools=None, environment_factory=None,
                 peft_config=None, sampler_factory: Callable[..., Sampler] | None = None, log=print):
        self.args = args = args.validate()
        # Which ranks train and sample: decided once, before anything starts (parallel/placement.py).
        placement = Placement.from_config(args, launched_world_size())
        if not placement.samples_here(launched_rank()):
            raise CohortError(f"SamplingRank on a rank that trains (rollout_gpus={args.rollout_gpus}): build a "
                              "GRPOTrainer on the ranks where cohort_grpo.is_sampling_rank(args) is False")
        toolbox = make_toolbox(tools, environment_factory, args, task)
        # The trainers' start-up (cohort_grpo/run/start.py): the same process groups, the same policy (the trainers'
        # parameters, LoRA adapters included, arrive in this copy), the same resolved config.
        start = start_rank(model, args, processing_class, placement=placement, toolbox=toolbox,
                           peft_config=peft_config, log=log, sampling_rank=True)
        self.args = args = start.args
        self.parallel = start.parallel
        self.model, self.tokenizer, pad_id = start.model, start.tokenizer, start.pad_id
        line = slots_line(args, start.placement, sampling_rank=True)  # this rank sizes its own engine: it says so itself
        if line:
            log(f"rank {self.parallel.rank}: {line}")
        layout = None
        if start.placement.split > 1:  # this rank keeps its shard; the whole model goes
            self.model, layout = split_for_sampling(self.model, self.parallel.link.tensor_parallel_group, args,
                                                    toolbox is not None)
        self.server = build_rollout_server(args, self.model, self.tokenizer, pad_id, toolbox, self.parallel.link,
                                           sampler_factory, shard_layout=layout)

    @property
    def sampler(self) -> Sampler:
        return self.server.sample.sampler

    def serve(self) -> int:
        """Serve the trainers until they stop, then leave the job; the number of rollouts sampled."""
        # SIGINT / SIGTERM reach every rank: the trainers finish their step and save, which needs this rank's
        # rollouts, so a first signal is noted and serving goes on until they stop (a second one stops it).
        stop = StopRequest()
        stop.install()
        try:
            with run_determinism(self.parallel.device, self.args.cpu_threads, self.args.full_determinism):
                served = self.server.serve()
        finally:
            stop.uninstall()
        self.parallel.close()
        print(f"cohort: rank {self.parallel.rank} sampled {served} rollouts for trainer rank(s) "
              f"{', '.join(map(str, self.server.trainers))}", file=sys.stderr, flush=True)
        return served
