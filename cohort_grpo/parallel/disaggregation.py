"""Sampling and training on different ranks of one torchrun job (`--rollout_gpus K`).

With W ranks, the first W − K train (DDP among themselves, as without this option) and the last K
only run the sampling engine. The W − K trainers are split into blocks of consecutive ranks, one per
sampling group, whose leader samples a step's requests of its block in one engine call (`RolloutServer`).
Which ranks sample, in which groups, and who serves whom is the run's `Placement`
(cohort_grpo/parallel/placement.py): with T > 1 the K sampling ranks form K / T groups of T consecutive ranks, each
one engine over a T-way shard of the model, whose first rank, its leader, reads its trainers' requests, relays
each to the group's other ranks (so every rank of the group runs the same engine call) and sends the rollouts
back. Three groups carry the traffic, made in the same order on every rank as torch.distributed requires:

- the trainers' group: every collective of the update (DDP's gradient all-reduce, metrics);
- the weights group, rank 0 and the samplers: after an update, rank 0 broadcasts the policy's
  weights to every sampler (NCCL between GPUs; nothing goes through the disk or a server);
- a gloo group of all ranks: sampling requests from trainers and rollouts back, as messages sent
  without blocking the sender (`RolloutLink.send`), read back with `torch.load(weights_only=True)`:
  plain values and tensors only, never code.

The schedule is that of asynchronous rollouts on one GPU (cohort_grpo/rollout/async_rollouts.py): the
rollout of step t is sampled from the weights after update t − 1 − max_staleness, whatever the
timing, so a disaggregated run draws the same samples as `--async_rollouts` in one process.
"""

from __future__ import annotations

import datetime
import io
from collections import deque

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.parallel.faults import wait_all, waiting_for, withheld_weights
from cohort_grpo.parallel.placement import Placement


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

    def form_sampling_groups(self, placement: Placement) -> None:
        """Group the sampling ranks by `placement`, the run's with its split settled (known once the model is
        loaded: `cohort_grpo.run.resolve`), making each group's process group (a collective: every rank of the job calls
        it, in the same order, before the first request)."""
        self.placement = placement
        if placement.split == 1:
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
        part = "sampling rank" if self.placement.samples_here(src) else "trainer rank"
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
