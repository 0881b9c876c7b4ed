"""Several processes with torchrun: data parallel (DDP) or sharded (FSDP2) training, and the few
collectives the trainer needs.

One process per GPU (or CPU process with gloo), started by `torchrun --nproc_per_node=N -m cohort_grpo
train ...` or by `cohort-grpo train --nproc_per_node N` (cohort_grpo/cli/launch.py), on one machine or on each of
several (`--nnodes M --node_rank R --master_addr HOST`: M·N ranks). The rank (RANK, global over the
machines) decides the prompts and who logs and saves (global rank 0 alone); the local rank
(LOCAL_RANK, the index on its machine) decides the GPU, cuda:LOCAL_RANK. Each rank samples and scores
its own prompts, whole groups of G completions (so group statistics stay local, as GRPO needs),
trains on them, and gradients are averaged over ranks by PyTorch's own engines:

- DDP (`torch.nn.parallel.DistributedDataParallel`, Li et al. 2020, "PyTorch Distributed"): every
  rank holds the whole model; gradients are all-reduced once per optimizer step (`no_sync` skips
  the all-reduce of every micro-batch but the last). The engine samples from the same module.
- FSDP2 (`torch.distributed.fsdp.fully_shard`; Zhao et al. 2023, "PyTorch FSDP"): parameters,
  gradients and optimizer state are sharded over ranks, each decoder layer gathered just before
  its use; on CUDA in bf16 for compute, fp32 for the gradient reduction and the master weights.
  For sampling, each rank keeps a plain full copy of the model (in the loaded dtype) that the
  engine reads; its weights are gathered once per step, after the update (`EngineCopy`,
  cohort_grpo/parallel/engine_copy.py, which the rollout source owns: it is no collective of the step). With
  `rollout_tensor_parallel_size` T > 1 (the colocated placement, cohort_grpo/parallel/colocation.py) the plain
  copy is replaced by this rank's T-way tensor-parallel shard, and consecutive groups of T ranks sample
  together.

Every rank computes the same data order and sampling seed; rank r takes the r-th contiguous
block of the step's prompts (`shard_bounds`) and keys its sampling noise by the global index of
each completion (`SamplingParams.sequence_offset`), so N ranks draw exactly the completions one
process would. Single process: every method is a no-op and `wrap` returns the module itself.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import threading
from typing import Iterator, Sequence

import torch
from torch import nn

from cohort_grpo.errors import CohortError
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.parallel.sharding import fully_sharded_copy

# Seconds `Parallel.close` waits for the process group's teardown.
DESTROY_TIMEOUT_S = 30


def shard_bounds(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s contiguous block of `count` items: sizes differ by at most one,
    the earlier ranks taking the extra ones.

    >>> [shard_bounds(10, r, 3) for r in range(3)]
    [(0, 4), (4, 7), (7, 10)]
    """
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def pick_device(spec: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """The device of this process: `auto` is CUDA when there is a GPU; several processes on CUDA
    each take GPU `local_rank` (whatever index `spec` names, torchrun assigns the GPUs)."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CohortError(f"device {spec!r} asked for, but no CUDA GPU is available; use --device cpu")
        if world_size > 1:
            if local_rank >= torch.cuda.device_count():
                raise CohortError(f"this node runs {local_rank + 1}+ processes but has {torch.cuda.device_count()} "
                                  "GPU(s); pass --nproc_per_node at most the number of GPUs")
            return torch.device("cuda", local_rank)
    return torch.device(spec)


def average_records(records: Sequence[dict], maximum: tuple[str, ...] = (),
                    counts: Sequence[dict] | None = None) -> dict:
    """One metrics record from every rank's: numbers averaged (the `maximum` keys: their largest),
    integers kept as integers when every rank agrees (step, counters), anything else (None,
    strings) as rank 0 has it. Keys are rank 0's, in its order.

    `counts` (one dict per rank): for a key that is a mean over only some of a rank's samples (those a reward
    function scored), how many; the ranks' means are weighted by them, as one process pooling the samples
    would, and a rank with none is left out (its value says nothing). Equal counts keep the plain average."""
    out = {}
    for key, first in records[0].items():
        values = [r.get(key) for r in records]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        weights = [c.get(key) for c in counts] if counts is not None else [None]
        if not numeric:
            out[key] = first
        elif all(isinstance(v, int) for v in values) and len(set(values)) == 1:
            out[key] = first
        elif key in maximum:
            out[key] = max(values)
        elif None not in weights and len(set(weights)) > 1:
            out[key] = weighted_mean(values, weights, first)
        else:
            out[key] = math.fsum(values) / len(values)
    return out


def weighted_mean(values: Sequence[float], weights: Sequence[float], fallback: float) -> float:
    """The mean of `values` weighted by `weights`, leaving out those of weight 0; `fallback` when all are 0."""
    kept = [(v, w) for v, w in zip(values, weights) if w > 0]
    if not kept:
        return fallback
    return math.fsum(v * w for v, w in kept) / math.fsum(w for _, w in kept)


class Parallel:
    """This process's place among the ranks, and the collectives of a data-parallel GRPO step."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0,
                 device: torch.device | None = None, owns_group: bool = False, group=None, link=None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = device or torch.device("cpu")
        self.owns_group = owns_group
        # The ranks that train, when some of the job's ranks only sample (--rollout_gpus): every collective
        # of the step runs in this group (None: all ranks). `link` connects trainers and samplers.
        self.group, self.link = group, link
        self.fsdp = False
        # FSDP2 ranks that sample in tensor-parallel groups (cohort_grpo/parallel/colocation.py): this rank's group.
        self.sampling_group = None

    # ---- set-up --------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, device_spec: str, timeout_s: float, placement: Placement | None = None) -> "Parallel":
        """From torchrun's RANK / WORLD_SIZE / LOCAL_RANK: one process group (NCCL on CUDA, gloo on
        CPU) whose collectives give up after `timeout_s` seconds, so a rank that died or hangs stops
        the others with an error instead of a silent wait. Without torchrun: one process, no group.

        RANK is global (over every machine), LOCAL_RANK this machine's index of the process: the GPU
        is cuda:LOCAL_RANK, so on a second machine rank 8 takes cuda:0, not cuda:8. Another launcher
        (SLURM's srun, mpirun) works when it sets what torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK,
        MASTER_ADDR and MASTER_PORT for env:// initialisation.

        With `placement` (the run's `Placement`) giving `rollout_gpus` = K, the last K ranks sample for the others
        (cohort_grpo/parallel/disaggregation.py; their tensor-parallel groups are formed once the run's config is
        settled, `RolloutLink.form_sampling_groups`):
        this object then describes the training ranks' group, or for a sampling rank, that rank alone. The
        link's message window is sized once the run's `max_staleness` is resolved (`RolloutLink.cover_staleness`)."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:  # a placement with sampling ranks refuses one process itself
            return cls(device=pick_device(device_spec))
        import torch.distributed as dist

        owns_group = not dist.is_initialized()
        needed = ("RANK", "MASTER_ADDR", "MASTER_PORT") if owns_group else ("RANK",)
        missing = [name for name in needed if not os.environ.get(name)]
        if missing:
            raise CohortError(f"WORLD_SIZE={world_size} but {', '.join(missing)} not set: start the ranks with "
                              "torchrun (or cohort-grpo train --nproc_per_node), or have your launcher set RANK, "
                              "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in every process")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        device = pick_device(device_spec, local_rank, world_size)
        if device.type == "cuda" and "LOCAL_RANK" not in os.environ and torch.cuda.device_count() > 1:
            raise CohortError(f"rank {rank}: LOCAL_RANK is not set, and it picks this process's GPU among the "
                              f"{torch.cuda.device_count()} here (cuda:LOCAL_RANK); have your launcher set it (under "
                              "SLURM's srun: LOCAL_RANK=$SLURM_LOCALID), or start the ranks with torchrun")
        if timeout_s <= 0:
            raise CohortError(f"ddp_timeout={timeout_s}: it must be a positive number of seconds")
        if owns_group:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        if placement is not None and placement.rollout_gpus:
            from cohort_grpo.parallel.disaggregation import RolloutLink

            link = RolloutLink.create(placement, rank, datetime.timedelta(seconds=timeout_s))
            if placement.samples_here(rank):
                return cls(rank, 1, local_rank, device, owns_group, link=link)
            return cls(rank, placement.trainers, local_rank, device, owns_group, group=link.trainer_group, link=link)
        return cls(rank, world_size, local_rank, device, owns_group)

    @property
    def is_main(self) -> bool:
        """Global rank 0 (node 0's first process): the one rank that prints, logs and saves."""
        return self.rank == 0

    def wrap(self, model: nn.Module, fsdp: bool = False) -> nn.Module:
        """The module the training forward calls: `model` itself (one process), DDP around it, or,
        with `fsdp`, a sharded fp32 copy (FSDP2) while `model` stays the plain copy the engine
        samples from and checkpoints save (an `EngineCopy`, cohort_grpo/parallel/engine_copy.py, brings it up to date)."""
        if self.world_size == 1:
            return model
        if fsdp:
            return self._fully_shard(model)
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        # Rotary tables and other buffers are identical on every rank: no need to re-send them each forward.
        newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        buffers = {"forward_sync_buffers" if newer else "broadcast_buffers": False}
        return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                                       process_group=self.group, **buffers)

    def _fully_shard(self, model: nn.Module) -> nn.Module:
        self._broadcast_from_main(model)
        sharded = self.sharded_copy(model, master_weights=self.device.type == "cuda")
        self.fsdp = True
        return sharded

    def sharded_copy(self, model: nn.Module, master_weights: bool = False) -> nn.Module:
        """A copy of `model` sharded by FSDP2 over the training ranks, one decoder layer per unit, built shard
        first (`sharding.fully_sharded_copy`). `master_weights` (the trained copy on a GPU): fp32 shards, bf16
        gathers and compute, fp32 gradient reduction; otherwise the shards keep `model`'s dtype (π_ref's frozen
        copy)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        # The mesh names the run's device and group: fully_shard's default mesh is CUDA whenever the
        # machine has a GPU (a --device cpu run then shards onto it) and spans every rank (sampling
        # ranks too).
        mesh = DeviceMesh.from_group(self.group or dist.group.WORLD, self.device.type)
        return fully_sharded_copy(model, mesh, self.device, master_weights)

    @torch.no_grad()
    def _broadcast_from_main(self, model: nn.Module) -> None:
        """Rank 0's parameters into every rank's `model`, in place, as DDP does when it wraps a module:
        machines that each built or converted the model themselves (the built-in tiny model is warm-started
        once per machine) may hold copies that differ in the last bits, and FSDP2 would shard them as they
        are (the plain sampling copy and π_ref too)."""
        import torch.distributed as dist

        for param in model.parameters():
            dist.broadcast(param.data, src=0)

    def optimizer_state(self, train_model: nn.Module, optimizer) -> dict:
        """What a checkpoint stores for the optimizer: its state_dict, or under FSDP2 the full
        (unsharded) one plus the fp32 weights, gathered on rank 0 (a collective: every rank calls it). The moments
        are gathered in their own dtype (bf16 ones, `ShardedAdamW`'s DTensors, stay bf16) and scattered back on load."""
        if not self.fsdp:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"fsdp_optimizer": get_optimizer_state_dict(train_model, optimizer, options=options),
                "fsdp_weights": get_model_state_dict(train_model, options=options)}

    def load_optimizer_state(self, train_model: nn.Module, optimizer, state: dict) -> None:
        """Inverse of `optimizer_state` (every rank calls it with the same loaded `state`)."""
        if not self.fsdp:
            optimizer.load_state_dict(state)
            return
        if "fsdp_optimizer" not in state:
            raise CohortError("this checkpoint was not written with --fsdp; resume it without --fsdp (the same "
                              "parallelism as the run that wrote it)")
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(train_model, state["fsdp_weights"], options=options)
        set_optimizer_state_dict(train_model, optimizer, state["fsdp_optimizer"], options=options)

    # ---- the step's collectives ----------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, module: nn.Module, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward. DDP: gradients are all-reduced only when `last`
        (its `no_sync` in between). FSDP2: reduce-scattered after every micro-batch, into the fp32 gradient
        shard they accumulate in.

        FSDP2 could skip the reduce-scatter too (`set_requires_gradient_sync(False)`), but then it keeps every
        parameter's unsharded gradient, upcast to fp32, until the last micro-batch: 4 bytes a parameter on
        every rank (30 GiB at 8B), against 4/N sharded. The traffic it saves is small against the micro-batch
        it rides on: each micro-batch already all-gathers every weight twice (forward and backward, 2 bytes
        each in bf16), so the fp32 reduce-scatter adds 4 bytes a parameter to the 4 already moved, overlapped
        with the backward's compute, and a micro-batch is at least ~1e14 FLOPs (`fast_path.MICRO_BATCH_FLOP`):
        at 8B over 2 H200s, ~16 GB a rank sends in ~0.05 s against ~0.2 s of compute. So always."""
        if self.world_size == 1 or hasattr(module, "set_requires_gradient_sync"):  # one process, FSDP2
            yield
        elif last or not hasattr(module, "no_sync"):
            yield
        else:
            with module.no_sync():
                yield

    def max_over_ranks(self, value: int) -> int:
        """The largest `value` of any rank (one collective)."""
        if self.world_size == 1:
            return int(value)
        import torch.distributed as dist

        tensor = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return int(tensor.item())

    def all_reduce_sums(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over ranks (float64, one collective)."""
        if self.world_size == 1:
            return [float(v) for v in values]
        import torch.distributed as dist

        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=self.group)
        return tensor.tolist()

    def all_reduce_sum(self, value: float) -> float:
        return self.all_reduce_sums([value])[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any (e.g. a signal that reached one rank only)."""
        return self.all_reduce_sum(1.0 if flag else 0.0) > 0

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)  # global rank 0 trains in every layout
        return box[0]

    def mean_metrics(self, record: dict, maximum: tuple[str, ...] = ("peak_memory_gib",),
                     counts: dict | None = None) -> dict:
        """`record` averaged over ranks (see `average_records`; `counts`: this rank's samples behind its keys that
        are means over some of them), the same on every rank; rank 0 logs it."""
        if self.world_size == 1:
            return record
        gathered = self.gather_objects((record, counts or {}))
        return average_records([r for r, _ in gathered], maximum, [c for _, c in gathered])

    def shard(self, items: list) -> list:
        """This rank's contiguous block of `items` (see `shard_bounds`)."""
        start, stop = shard_bounds(len(items), self.rank, self.world_size)
        return items[start:stop]

    def evaluation_rows(self, rows: list) -> list:
        """The held-out rows this rank evaluates: its block, or in a tensor-parallel sampling group its group's
        block, the same on each of the group's ranks (their engine calls are one call)."""
        group = self.sampling_group
        return self.shard(rows) if group is None else group.block(rows)

    def evaluation_sums(self, values: Sequence[float]) -> list[float]:
        """Sums over ranks of what each evaluated (`evaluation_rows`): a sampling group's counts once, its leader's."""
        group = self.sampling_group
        counted = values if group is None or group.leader == self.rank else [0.0] * len(values)
        return self.all_reduce_sums(counted)

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def close(self) -> None:
        """Destroy the process group this object created (the end of a run)."""
        if self.owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                # NCCL's teardown can wait on a peer forever (a communicator a CUDA graph still references, a
                # rank already gone): the run's results are written by now, so a bounded wait, then move on.
                done = threading.Thread(target=dist.destroy_process_group, daemon=True)
                done.start()
                done.join(DESTROY_TIMEOUT_S)
                if done.is_alive():
                    print(f"cohort: rank {self.rank}: the process group's teardown did not finish within "
                          f"{DESTROY_TIMEOUT_S} s; leaving it (the run's outputs are complete)", file=sys.stderr, flush=True)
            self.owns_group = False


class SilentMetrics:
    """The metrics logger of ranks other than 0: rank 0 writes the job's (already averaged) records."""

    def log(self, step: int, metrics: dict) -> dict:
        return metrics

    def log_completions(self, step: int, rows) -> None:
        pass

    def close(self) -> None:
        pass


def silent(*_args, **_kwargs) -> None:
    """The `log` of ranks other than 0."""
