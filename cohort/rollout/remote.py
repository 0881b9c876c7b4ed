"""Asynchronous rollouts sampled on other ranks (`--rollout_gpus K`, cohort/run/disaggregation.py).

`RemoteRollouts` is the trainer's side, with the interface of `AsyncRollouts` (cohort/rollout/
async_rollouts.py), so the training loop is the same: after an update it submits the rollouts the
schedule starts then, and each step takes its own. A submission is a message to this trainer's
sampling rank (the rows, the seed, the noise offset, the policy version); rank 0 also broadcasts
the weights of each new version to the sampling ranks once. `RolloutServer` is the sampling rank's
loop: read the next request of each trainer it serves, give it to the next of its lanes (each a copy
of the policy: rollouts of consecutive policy versions decode at once, see `SamplingLane`), load the
version's weights into that lane, sample, send each rollout back as soon as it is done.

Messages carry plain values (`batch_state`); the weights travel from a snapshot taken after the
update, so the broadcast runs while the next update changes the live weights.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from ..errors import CohortError
from ..run.disaggregation import REQUESTS, ROLLOUTS
from .async_rollouts import batch_from_state, batch_state, steps_to_start, weights_snapshot
from .batch import Batch

SAMPLE, ROLLOUT, STOP = "sample", "rollout", "stop"


class RemoteRollouts:
    """A trainer's rollouts, sampled by its sampling rank.

    link: the job's `RolloutLink`; rank: this trainer's global rank."""

    def __init__(self, link, rank: int, max_staleness: int):
        if max_staleness < 1:
            raise CohortError(f"max_staleness={max_staleness}: rollouts on other ranks are at least 1 update behind")
        self.link, self.rank, self.max_staleness = link, rank, max_staleness
        self.server = link.placement.server_of(rank)
        self.pending: dict[int, int] = {}  # step -> policy version: submitted or loaded, not yet taken
        self.received: dict[int, Batch] = {}
        self.published_version: int | None = None
        self.closed = False

    def snapshot(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The weights to send with the next submissions: rank 0 alone sends them (every trainer holds the
        same), so only rank 0 copies them."""
        return weights_snapshot(model) if self.rank == 0 else None

    def submit(self, step: int, version: int, weights: dict[str, torch.Tensor] | None, rows: list[dict], seed: int,
               sequence_offset: int) -> None:
        """Ask for the rollout of `step`, sampled from `weights` (the policy after `version` updates; rank 0's
        snapshot, None on the other trainers)."""
        self.link.send((SAMPLE, step, version, rows, seed, sequence_offset), self.server, REQUESTS)
        self.pending[step] = version
        if version != self.published_version:
            self.published_version = version
            if weights is not None:  # rank 0's (`snapshot`)
                self.link.publish_weights(list(weights.values()))

    def take(self, step: int) -> tuple[Batch, int]:
        """The rollout of `step` (waiting for it) and the policy version it was sampled from."""
        if step not in self.pending:
            raise CohortError(f"no rollout was requested for step {step}")
        self.receive_until(step)
        return self.received.pop(step), self.pending.pop(step)

    def receive_until(self, step: int) -> None:
        while step not in self.received:
            kind, done_step, state = self.link.receive(self.server, ROLLOUTS)
            if kind != ROLLOUT:
                raise CohortError(f"rank {self.rank}: expected a rollout from sampling rank {self.server}, got {kind!r}")
            self.received[done_step] = batch_from_state(state)

    def steps_ahead(self, step: int) -> list[int]:
        return steps_to_start(step, self.max_staleness, bool(self.pending))

    def state_dict(self) -> dict:
        """The rollouts requested and not yet trained on (waited for), for a checkpoint."""
        if self.pending:
            self.receive_until(max(self.pending))
        return {"pending": [{"step": step, "version": version, **batch_state(self.received[step])}
                            for step, version in sorted(self.pending.items())]}

    def load_state_dict(self, state: dict) -> None:
        """The rollouts a checkpoint saved, as if just received."""
        for item in state.get("pending", []):
            self.received[item["step"]] = batch_from_state(item)
            self.pending[item["step"]] = item["version"]

    def close(self) -> None:
        """Tell the sampling rank this trainer is done; wait until what it sent has gone. Once only."""
        if not self.closed:
            self.closed = True
            self.link.send((STOP,), self.server, REQUESTS)
            self.link.flush()


class SamplingLane:
    """One rollout in flight on a sampling rank: a copy of the policy, the sampler over it, and (on CUDA) a
    stream of its own, so its decode steps run beside another lane's."""

    def __init__(self, policy: torch.nn.Module, sample: Callable[..., Batch]):
        self.policy, self.sample = policy, sample
        self.version: int | None = None  # the policy version its weights hold
        self.job: tuple[int, int, Future] | None = None  # (trainer, step, its sampling) while it samples
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cohort-lane")
        device = next(policy.parameters()).device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, link, trainer: int, step: int, rows: list[dict], seed: int, sequence_offset: int) -> None:
        """Sample on the lane's thread and stream, then send the rollout to `trainer` from there."""
        def job() -> None:
            with contextlib.ExitStack() as scope:
                if self.stream is not None:
                    # A thread starts on GPU 0, whatever rank it serves: the engine's streams, events and
                    # synchronisations must be those of the lane's GPU.
                    torch.cuda.set_device(self.stream.device)
                    scope.enter_context(torch.cuda.stream(self.stream))
                batch = self.sample(rows, seed, sequence_offset)
            link.send((ROLLOUT, step, batch_state(batch)), trainer, ROLLOUTS)  # the engine's rollouts are on the CPU

        self.job = (trainer, step, self.worker.submit(job))

    def finish(self) -> bool:
        """Wait for the lane's rollout, if any, to be sampled and sent; whether there was one."""
        if self.job is None:
            return False
        job, self.job = self.job[2], None
        job.result()  # an error while sampling ends the server here
        return True


class RolloutServer:
    """A sampling rank's loop: requests in, rollouts out, weights loaded per policy version.

    lanes: the rollouts this rank samples at once, each on its own copy of the policy. With two, the
    rollout of step t + 1 (the policy after one more update) starts while the longest completions of step
    t are still decoding, so the GPU is not left to a few stragglers. Each rollout is sampled from the
    weights its request names, on its own lane, so what is sampled never depends on the timing."""

    def __init__(self, link, lanes: list[SamplingLane]):
        if not lanes:
            raise CohortError("a sampling rank needs at least one lane")
        self.link, self.lanes = link, lanes
        self.trainers = link.placement.served_by(link.rank)
        self.latest: SamplingLane | None = None  # the lane holding the newest weights received
        self.served = 0

    def serve(self) -> int:
        """Serve until every trainer has stopped; the number of rollouts sampled."""
        live, turn = list(self.trainers), 0
        try:
            while live:
                for trainer in list(live):
                    request = self.link.receive(trainer, REQUESTS)
                    if request[0] == STOP:
                        live.remove(trainer)
                        continue
                    _, step, version, rows, seed, sequence_offset = request
                    lane = self.lanes[turn % len(self.lanes)]
                    turn += 1
                    self.served += lane.finish()
                    self.load_weights(lane, version)
                    lane.start(self.link, trainer, step, rows, seed, sequence_offset)
            for lane in self.lanes:
                self.served += lane.finish()
        finally:
            for lane in self.lanes:
                lane.worker.shutdown(wait=True, cancel_futures=True)
        self.link.flush()
        return self.served

    @torch.no_grad()
    def load_weights(self, lane: SamplingLane, version: int) -> None:
        """Give the (idle) lane the weights of `version`: rank 0 broadcasts each version once, so a version
        already received goes from the lane holding it (which may be sampling with it: a read)."""
        if lane.version == version:
            return
        target = list(lane.policy.state_dict().values())
        if self.latest is not None and self.latest.version == version:
            for mine, theirs in zip(target, self.latest.policy.state_dict().values()):
                mine.copy_(theirs)
        else:
            self.link.receive_weights(target)
            self.latest = lane
        lane.version = version
        if target and target[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # the lane's own stream reads them next
