"""Sampling and training on different ranks of one torchrun job (`--rollout_gpus K`).

With W ranks, the first W − K train (DDP among themselves, as without this option) and the last K
only run the sampling engine. The T = W − K trainers are split into K blocks of consecutive ranks,
block k served by sampler T + k, which samples a step's requests of its block in one engine call
(`RolloutServer`). Three groups
carry the traffic, made in the same order on every rank as torch.distributed requires:

- the trainers' group: every collective of the update (DDP's gradient all-reduce, metrics);
- the weights group, rank 0 and the samplers: after an update, rank 0 broadcasts the policy's
  weights to every sampler (NCCL between GPUs; nothing goes through the disk or a server);
- a gloo group of all ranks: sampling requests from trainers and rollouts back, as messages sent
  without blocking the sender (`RolloutLink.send`), read back with `torch.load(weights_only=True)`:
  plain values and tensors only, never code.

The schedule is that of asynchronous rollouts on one GPU (cohort/rollout/async_rollouts.py): the
rollout of step t is sampled from the weights after update t − 1 − max_staleness, whatever the
timing, so a disaggregated run draws the same samples as `--async_rollouts` in one process.
"""

from __future__ import annotations

import datetime
import io
import os
from collections import deque
from dataclasses import dataclass

import torch

from cohort.errors import CohortError
from cohort.parallel.faults import wait_all, waiting_for, withheld_weights


@dataclass(frozen=True)
class Placement:
    """Which ranks train and which sample, and who serves whom.

    With `tensor_parallel_size` T > 1 the K sampling ranks form K / T groups of T consecutive ranks, each
    group one engine over a T-way shard of the model (cohort/models/tensor_parallel.py). The first rank of
    a group, its leader, talks to the trainers: it reads their requests, relays each to the group's other
    ranks (so every rank of the group runs the same engine call) and sends the rollouts back."""

    world_size: int
    rollout_gpus: int
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if not 0 < self.rollout_gpus < self.world_size:
            raise CohortError(f"rollout_gpus={self.rollout_gpus} with {self.world_size} ranks: at least one rank must "
                              f"train and one sample; give 1 to {self.world_size - 1}, or start more processes")
        size = self.tensor_parallel_size
        if size < 1 or self.rollout_gpus % size:
            raise CohortError(f"rollout_tensor_parallel_size={size} with rollout_gpus={self.rollout_gpus}: the sampling "
                              "ranks form groups of that many ranks, so it must divide rollout_gpus (e.g. "
                              f"--rollout_gpus {max(size, 1) * max(1, self.rollout_gpus // max(size, 1))})")
        if size > 1 and self.groups > self.trainers:
            raise CohortError(f"rollout_gpus={self.rollout_gpus} in {self.groups} sampling group(s) for {self.trainers} "
                              "trainer rank(s): a group would serve no trainer; use fewer sampling ranks or a larger "
                              "--rollout_tensor_parallel_size")

    @property
    def trainers(self) -> int:
        return self.world_size - self.rollout_gpus

    @property
    def groups(self) -> int:
        """How many sampling groups (engines) there are."""
        return self.rollout_gpus // self.tensor_parallel_size

    def samples(self, rank: int) -> bool:
        return rank >= self.trainers

    def group_ranks(self, group: int) -> list[int]:
        """The ranks of sampling group `group`, its leader first."""
        first = self.trainers + group * self.tensor_parallel_size
        return list(range(first, first + self.tensor_parallel_size))

    def leader_of(self, rank: int) -> int:
        """The leader of sampling rank `rank`'s group (itself when it leads or T = 1)."""
        return rank - (rank - self.trainers) % self.tensor_parallel_size

    def group_of(self, rank: int) -> list[int]:
        """The ranks of sampling rank `rank`'s group, its leader first."""
        return self.group_ranks((rank - self.trainers) // self.tensor_parallel_size)

    def server_of(self, trainer: int) -> int:
        """The sampling rank (a group's leader) that serves trainer rank `trainer`: the trainers in one block of
        consecutive ranks per group (sizes differing by one at most), so a group's trainers own consecutive
        completions of a step."""
        return self.group_ranks(trainer * self.groups // self.trainers)[0]

    def served_by(self, server: int) -> list[int]:
        """The trainer ranks the group of sampling rank `server` serves, in rank order."""
        leader = self.leader_of(server)
        return [t for t in range(self.trainers) if self.server_of(t) == leader]


def samples_here(rollout_gpus: int) -> bool:
    """Whether this process, by torchrun's RANK and WORLD_SIZE, is one of the last `rollout_gpus` ranks, which
    only sample; False in a single process (where rollout_gpus > 0 fails later, with its own message)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if not rollout_gpus or world_size <= 1:
        return False
    return Placement(world_size, rollout_gpus).samples(int(os.environ.get("RANK", "0")))


class RolloutLink:
    """This rank's end of the traffic between trainers and samplers."""

    def __init__(self, placement: Placement, rank: int, trainer_group, weights_group, message_group,
                 messages_in_flight: int = 3, timeout_s: float = 1800.0, poll_weights: bool = False):
        self.placement, self.rank = placement, rank
        # A sampling rank's group of T ranks sharing one engine (None with T = 1 and on trainers): the shard's
        # collectives (all-reduces in the layers, the vocabulary-parallel draw) run in it.
        self.tensor_parallel_group = None
        # The weight broadcast's deadline; poll_weights: its works complete without wait() (NCCL), see `wait_all`.
        self.timeout_s, self.poll_weights = timeout_s, poll_weights
        self.trainer_group, self.weights_group, self.message_group = trainer_group, weights_group, message_group
        # Per destination, the messages sent and perhaps not yet read: (work handles, the buffers they read).
        # gloo's is_completed() stays False until wait() is called, so the sender waits for the oldest once
        # more than `messages_in_flight` are kept; the schedule leaves at most max_staleness + 1 unread in
        # either direction, so with max_staleness + 2 that wait returns at once, and memory stays bounded.
        self.in_flight: dict[int, deque] = {}
        self.messages_in_flight = messages_in_flight
        self.weights_in_flight: list = []

    @classmethod
    def create(cls, placement: Placement, rank: int, timeout: datetime.timedelta,
               max_staleness: int = 1) -> "RolloutLink":
        """The three groups (a collective: every rank of the job calls it, in the same order)."""
        import torch.distributed as dist

        trainer_group = dist.new_group(list(range(placement.trainers)), timeout=timeout)
        # On NCCL, `wait_all` ends a broadcast that hangs after `timeout`, in one line; NCCL's watchdog, which
        # aborts the process with a page of log, is left as the backstop, twice as late.
        poll = dist.get_backend() == "nccl"
        weights_group = dist.new_group([0, *range(placement.trainers, placement.world_size)],
                                       timeout=timeout * 2 if poll else timeout)
        message_group = dist.new_group(list(range(placement.world_size)), backend="gloo", timeout=timeout)
        return cls(placement, rank, trainer_group, weights_group, message_group,
                   messages_in_flight=max_staleness + 2, timeout_s=timeout.total_seconds(), poll_weights=poll)

    def form_sampling_groups(self, tensor_parallel_size: int) -> None:
        """Group the sampling ranks by the run's settled `rollout_tensor_parallel_size` (known once the model is
        loaded: `cohort.run.resolve`), making each group's process group (a collective: every rank of the job calls
        it, in the same order, before the first request)."""
        placement = Placement(self.placement.world_size, self.placement.rollout_gpus, tensor_parallel_size)
        self.placement = placement
        if tensor_parallel_size == 1:
            return
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        for group in range(placement.groups):  # every rank makes every group, in the same order
            made = dist.new_group(placement.group_ranks(group), timeout=timeout)
            if self.rank in placement.group_ranks(group):
                self.tensor_parallel_group = made

    def cover_staleness(self, max_staleness: int) -> None:
        """Size the message window for the run's resolved `max_staleness` (settled once the model is loaded,
        after this link is made; no message has been sent by then)."""
        self.messages_in_flight = max_staleness + 2

    # ---- messages (gloo; plain values and CPU tensors) -------------------------------------------
    def send(self, obj, dst: int) -> None:
        """Start sending `obj` to rank `dst` and return; messages to one rank arrive in order."""
        import torch.distributed as dist

        buffer = io.BytesIO()
        torch.save(obj, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        works = [dist.isend(size, dst, group=self.message_group), dist.isend(payload, dst, group=self.message_group)]
        sent = self.in_flight.setdefault(dst, deque())
        sent.append((works, (size, payload)))
        while len(sent) > self.messages_in_flight:
            for work in sent.popleft()[0]:
                work.wait()

    def receive(self, src: int):
        """The next message from rank `src` (waits for it)."""
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64)
        part = "sampling rank" if self.placement.samples(src) else "trainer rank"
        with waiting_for(f"a message from {part} {src}"):
            dist.recv(size, src, group=self.message_group)
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(payload, src, group=self.message_group)
        try:
            return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        except Exception as error:  # pickle.UnpicklingError: a type outside weights_only's plain values
            raise CohortError(f"rank {self.rank}: a message from rank {src} holds a value only pickled code could "
                              f"rebuild ({str(error).splitlines()[0][:160]}); keep dataset columns to plain Python "
                              "values (str, int, float, lists, dicts)") from None

    # ---- weights (rank 0 to every sampler) ------------------------------------------------------------
    def publish_weights(self, tensors: list[torch.Tensor], version: int | None = None) -> None:
        """Rank 0: start broadcasting `tensors` (a snapshot nothing writes meanwhile), the policy after `version`
        updates, to the samplers."""
        import torch.distributed as dist

        self.wait_weights()
        if version is not None and withheld_weights(version):
            return
        works = [dist.broadcast(t, src=0, group=self.weights_group, async_op=True) for t in tensors]
        self.weights_in_flight = [works, tensors, version]

    def receive_weights(self, tensors: list[torch.Tensor], version: int | None = None) -> None:
        """A sampler: rank 0's broadcast of the policy after `version` updates, into `tensors` in place (the
        engine's graphs keep their addresses), within --ddp_timeout."""
        import torch.distributed as dist

        works = [dist.broadcast(tensor, src=0, group=self.weights_group, async_op=True) for tensor in tensors]
        wait_all(works, f"the weight broadcast of policy version {version} from rank 0", self.timeout_s,
                 self.poll_weights)

    def weights_one_by_one(self, layout: list[tuple[str, torch.Size, torch.dtype]], device, version: int | None = None):
        """A sampler holding a tensor-parallel shard: rank 0's broadcast of the whole policy (`layout`: each
        tensor's name, shape and dtype, in the order rank 0 sends them) as (name, tensor) pairs, one at a time
        in a buffer of its shape that the next tensor of that shape overwrites: the consumer copies its slice
        (`resharding.update_shard_`) before asking for the next. The rank holds one layer's worth of whole
        tensors beyond its shard, never a copy of the model."""
        import torch.distributed as dist

        buffers: dict[tuple, torch.Tensor] = {}
        for name, shape, dtype in layout:
            buffer = buffers.get((tuple(shape), dtype))
            if buffer is None:  # allocated once per shape (setdefault would allocate for every tensor)
                buffer = buffers[(tuple(shape), dtype)] = torch.empty(shape, dtype=dtype, device=device)
            work = dist.broadcast(buffer, src=0, group=self.weights_group, async_op=True)
            wait_all([work], f"the weight broadcast of policy version {version} from rank 0 ({name})", self.timeout_s,
                     self.poll_weights)
            yield name, buffer

    def wait_weights(self) -> None:
        if self.weights_in_flight:
            works, _, version = self.weights_in_flight
            self.weights_in_flight = []
            wait_all(works, f"the weight broadcast of policy version {version} to the sampling ranks", self.timeout_s,
                     self.poll_weights)

    def flush(self) -> None:
        """Wait until everything this rank started sending has gone."""
        for sent in self.in_flight.values():
            for works, _ in sent:
                for work in works:
                    work.wait()
        self.in_flight = {}
        self.wait_weights()
