"""The run's placement: which ranks train and which sample, in which tensor-parallel groups, on which copy of the
weights, and what is released between phases, decided once from the validated config and the process count,
before any weight loads (`Placement.from_config`).

With W processes and `rollout_gpus` K, the first W − K ranks train and the last K only sample
(cohort_grpo/parallel/disaggregation.py). The sampling split T (`rollout_tensor_parallel_size`) groups T consecutive
ranks into one engine over a T-way shard of the model: the sampling ranks, or, under FSDP2 without sampling
ranks, the training ranks themselves (the colocated placement, cohort_grpo/parallel/colocation.py). `auto` T is
settled once the model is loaded (cohort_grpo/plans/sampling_plan.py, `settled`). Every refusal that needs both the
config and the process count is made here, in one line; what the config alone decides is checked by the config.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from cohort_grpo.errors import CohortError

# How a trainer rank's rollouts are sampled: in the step itself; ahead, on a producer thread over a second copy
# of the policy; ahead, on the engine's own copy refreshed in place after each update; by sampling ranks.
ASYNC_MODES = ("sync", "producer_copy", "in_place", "remote")


def launched_world_size() -> int:
    """The job's processes, as torchrun (or a launcher that sets what it sets) gives WORLD_SIZE; 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's global rank, torchrun's RANK; 0 without one."""
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class Placement:
    """Where the ranks of a job of `world_size` processes train and sample.

    rollout_gpus: K, the last ranks, which only sample. split: T, the ranks of one sampling group (`auto` until
    settled). fsdp, async_rollouts, max_staleness (as asked; None settles to 1 where the engine samples in
    place), free_sampling_memory, lora: the options that decide which copy of the weights samples and what is
    released between phases."""

    world_size: int
    rollout_gpus: int = 0
    split: int | str = 1
    fsdp: bool = False
    async_rollouts: bool = False
    max_staleness: int | None = None
    free_sampling_memory: bool = False
    lora: bool = False

    @classmethod
    def from_config(cls, args, world_size: int) -> "Placement":
        """The placement of the run `args` (a validated config) on `world_size` processes; refused in one line
        where the two do not fit together."""
        placement = cls(world_size=world_size, rollout_gpus=args.rollout_gpus, split=args.rollout_tensor_parallel_size,
                        fsdp=bool(args.fsdp), async_rollouts=bool(args.async_rollouts),
                        max_staleness=args.max_staleness, free_sampling_memory=bool(args.free_sampling_memory),
                        lora=bool(args.use_peft))
        placement.check_options(args)
        return placement

    def __post_init__(self):
        world, k, size = self.world_size, self.rollout_gpus, self.split
        if k and k >= world:
            raise CohortError(f"rollout_gpus={k} needs ranks that train besides the ones that sample, and {world} "
                              f"process(es) leave none; start {k + 1} or more processes (--nproc_per_node), or give "
                              f"--rollout_gpus {'0' if world == 1 else '1' if world == 2 else f'1 to {world - 1}'}")
        if size == "auto":
            return  # settled once the model is loaded
        if self.lora and size > 1:  # known from the options: refused before torchrun starts a rank
            from cohort_grpo.models.tensor_parallel import lora_split_refusal

            raise lora_split_refusal(size)
        if k and k % size:
            raise CohortError(f"rollout_tensor_parallel_size={size} with rollout_gpus={k}: the sampling ranks form "
                              f"groups of that many ranks, so it must divide rollout_gpus (e.g. --rollout_gpus "
                              f"{size * max(1, k // size)})")
        if k and size > 1 and k // size > self.trainers:
            raise CohortError(f"rollout_gpus={k} in {k // size} sampling group(s) for {self.trainers} trainer rank(s): "
                              "a group would serve no trainer; use fewer sampling ranks or a larger "
                              "--rollout_tensor_parallel_size")
        if not k and self.fsdp and size > 1 and world % size:
            raise CohortError(f"rollout_tensor_parallel_size={size} does not divide the {world} training rank(s), "
                              "which sample in groups of that many (--fsdp without --rollout_gpus); give a divisor of "
                              f"{world}, or start a multiple of {size} processes")
        if self.colocated and self.async_rollouts and self.max_staleness not in (None, 1):
            raise CohortError(f"async_rollouts with rollout_tensor_parallel_size={size} on the training ranks samples "
                              "on the shard the trainer refreshes after each update, 1 update behind; pass "
                              "--max_staleness 1, or --rollout_gpus K to sample further ahead on ranks of their own")

    def check_options(self, args) -> None:
        """Options of `args` whose statistics would differ between one training rank and several, refused on
        several with the fix (each rank would otherwise use only its own part of the batch)."""
        if self.trainers == 1:
            return
        ranks = f"with {self.trainers} ranks"
        if args.scale_rewards == "batch":
            raise CohortError(f"scale_rewards='batch' {ranks} would divide by each rank's own reward std, not the "
                              "batch's; use --scale_rewards group (GRPO) or none (Dr. GRPO), or run one process")
        if args.dynamic_sampling:
            raise CohortError(f"dynamic_sampling {ranks} is not supported (each rank would resample a different "
                              "number of times); leave it off or run one process")
        if hasattr(args, "cliprange_value"):  # cohort_grpo.ppo.PPOConfig: the critic is neither wrapped nor averaged
            raise CohortError(f"PPO {ranks} is not supported (the critic would train on each rank's batch alone); "
                              "run PPOTrainer in one process")
        if args.rm_updates_per_step or args.rm_warmup_batches:
            raise CohortError(f"training a reward model online {ranks} is not supported (each rank would train its "
                              "own); set --rm_updates_per_step 0 --rm_warmup_batches 0 or run one process")

    def settled(self, split: int) -> "Placement":
        """This placement with its sampling split settled to `split` (`auto` resolved once the model is loaded)."""
        return dataclasses.replace(self, split=split)

    # ---- which ranks train and which sample ------------------------------------------------------------
    @property
    def trainers(self) -> int:
        """How many ranks train: the first ones."""
        return self.world_size - self.rollout_gpus

    @property
    def training_ranks(self) -> range:
        return range(self.trainers)

    @property
    def sampling_ranks(self) -> range:
        """The ranks that only sample (`rollout_gpus`, the last ones); none without them."""
        return range(self.trainers, self.world_size)

    def samples_here(self, rank: int) -> bool:
        """Whether rank `rank` only samples (one of the last `rollout_gpus`)."""
        return rank >= self.trainers

    # ---- where the training ranks sample ------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """FSDP2 shards the training state over several training ranks."""
        return self.fsdp and self.trainers > 1

    @property
    def fsdp_ranks_sample(self) -> bool:
        """FSDP2 over several ranks and no sampling ranks: the training ranks sample themselves, each on a whole
        copy or, with T > 1, in tensor-parallel groups (`colocated`); T is theirs to choose (`auto`)."""
        return self.sharded and not self.rollout_gpus

    @property
    def colocated(self) -> bool:
        """FSDP2 ranks that sample in tensor-parallel groups of T > 1, each keeping its shard of the model."""
        return self.fsdp and not self.rollout_gpus and isinstance(self.split, int) and self.split > 1

    @property
    def widest_split(self) -> int:
        """The split a memory plan takes before `auto` is settled: the one asked for, or, for FSDP2 ranks that
        sample themselves, all of them in one group (so that no run `auto` could fit is refused); else 1."""
        if not self.fsdp_ranks_sample:
            return 1
        return self.trainers if self.split == "auto" else self.split

    # ---- the sampling groups (T settled) -------------------------------------------------------------------
    @property
    def grouped_ranks(self) -> range:
        """The ranks that form the sampling groups: the sampling ranks, or without them the training ranks."""
        return self.sampling_ranks if self.rollout_gpus else self.training_ranks

    @property
    def groups(self) -> int:
        """How many sampling groups (engines) there are."""
        return len(self.grouped_ranks) // self.settled_split()

    def group_ranks(self, group: int) -> list[int]:
        """The ranks of sampling group `group`, its leader first."""
        first = self.grouped_ranks.start + group * self.settled_split()
        return list(range(first, first + self.settled_split()))

    def leader_of(self, rank: int) -> int:
        """The leader of rank `rank`'s sampling group (itself when it leads or T = 1)."""
        return rank - (rank - self.grouped_ranks.start) % self.settled_split()

    def group_of(self, rank: int) -> list[int]:
        """The ranks of rank `rank`'s sampling group, its leader first."""
        return self.group_ranks((rank - self.grouped_ranks.start) // self.settled_split())

    def server_of(self, trainer: int) -> int:
        """With sampling ranks: the one (a group's leader) that serves trainer rank `trainer`, the trainers in one
        block of consecutive ranks per group (sizes differing by one at most), so a group's trainers own
        consecutive completions of a step."""
        return self.group_ranks(trainer * self.groups // self.trainers)[0]

    def served_by(self, server: int) -> list[int]:
        """The trainer ranks the group of sampling rank `server` serves, in rank order."""
        leader = self.leader_of(server)
        return [t for t in range(self.trainers) if self.server_of(t) == leader]

    def settled_split(self) -> int:
        """T, once settled (the groups of an `auto` split are not known yet)."""
        if self.split == "auto":
            raise RuntimeError("the sampling groups of a Placement whose split is still auto: settle it first")
        return self.split

    # ---- which copy samples, and what is released -----------------------------------------------------------
    @property
    def async_mode(self) -> str:
        """How a trainer rank's rollouts are sampled (`ASYNC_MODES`)."""
        if not self.async_rollouts:
            return "sync"
        if self.rollout_gpus:
            return "remote"
        return "in_place" if self.samples_in_place else "producer_copy"

    @property
    def samples_in_place(self) -> bool:
        """Asynchronous rollouts on the engine's own copy, refreshed in place (cohort_grpo/rollout/async_rollouts.py):
        under FSDP2 without sampling ranks, one update behind (max_staleness None settles to 1 there), and always
        on a colocated tensor-parallel group's shards."""
        return (self.async_rollouts and self.fsdp and not self.rollout_gpus
                and (self.max_staleness in (None, 1) or self.colocated))

    @property
    def producer_copy(self) -> bool:
        """Asynchronous rollouts that keep a second copy of the policy for their producer thread: in one process
        or under DDP; under FSDP2 they sample on the engine's own copy, one update behind."""
        return self.async_mode == "producer_copy"

    @property
    def engine_released_in_update(self) -> bool:
        """The engine's weights are freed between a rollout and the weight refresh that rewrites them
        (`EngineCopy.release`): under FSDP2 with `free_sampling_memory`, synchronous (an
        asynchronous engine samples during the update), without LoRA (π_ref is that copy with its adapters off)."""
        return self.fsdp and self.free_sampling_memory and not self.async_rollouts and not self.lora
