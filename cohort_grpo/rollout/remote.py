"""Asynchronous rollouts sampled on other ranks (`--rollout_gpus K`, cohort_grpo/parallel/disaggregation.py).

`RemoteRollouts` is the trainer's side, with the interface of `AsyncRollouts` (cohort_grpo/rollout/
async_rollouts.py), so one `SampledAhead` (cohort_grpo/rollout/source.py) drives either and the training loop
is the same: after an update it submits the rollouts the schedule starts then, and each step takes its own. A submission is a message to this trainer's
sampling rank (the rows, the seed, the noise offset, the policy version); rank 0 also broadcasts
the weights of each new version to the sampling ranks once. `RolloutServer` is the sampling rank's
loop: read the next request of each trainer it serves, load the version's weights when it changes,
sample, send each rollout back. Requests are served in order, so version t's weights are loaded
exactly when the first rollout that needs them is sampled.

Messages carry plain values (`Batch.state`); the weights travel from a snapshot taken after the
update, so the broadcast runs while the next update changes the live weights.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.models.resharding import update_shard_
from cohort_grpo.rollout.async_rollouts import steps_to_start, weights_snapshot
from cohort_grpo.rollout.batch import Batch, select_groups, without_extra_padding
from cohort_grpo.rollout.partial import GroupPool, PartialRollouts

SAMPLE, ROLLOUT, STOP, RESTORE = "sample", "rollout", "stop", "restore"


class RemoteRollouts:
    """A trainer's rollouts, sampled by its sampling rank.

    link: the job's `RolloutLink`; rank: this trainer's global rank. partial: the sampling rank runs partial
    rollouts (cohort_grpo/rollout/partial.py): requests go out 1 update ahead, the first with a second batch of
    prompts, and each rollout comes with its oldest tokens' version and the pool it leaves (for checkpoints)."""

    in_place = False  # the sampling rank's engine is not this rank's: nothing of it to wait for

    def __init__(self, link, rank: int, max_staleness: int, partial: bool = False):
        if max_staleness < 1:
            raise CohortError(f"max_staleness={max_staleness}: rollouts on other ranks are at least 1 update behind")
        self.link, self.rank, self.max_staleness, self.partial = link, rank, max_staleness, partial
        self.lag = 1 if partial else max_staleness
        self.server = link.placement.server_of(rank)
        self.pending: dict[int, int] = {}  # step -> policy version: submitted or loaded, not yet taken
        self.received: dict[int, Batch] = {}
        self.versions: dict[int, int] = {}  # step -> the version of its oldest tokens, as the sampling rank says
        self.pool: dict | None = None  # partial rollouts: the sampling rank's pool after the newest rollout
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
        self.link.send((SAMPLE, step, version, rows, seed, sequence_offset), self.server)
        self.pending[step] = version
        if version != self.published_version:
            self.published_version = version
            if weights is not None:  # rank 0's (`snapshot`)
                self.link.publish_weights(list(weights.values()), version)

    def take(self, step: int) -> tuple[Batch, int]:
        """The rollout of `step` (waiting for it) and the policy version of its oldest tokens."""
        if step not in self.pending:
            raise CohortError(f"no rollout was requested for step {step}")
        self.receive_until(step)
        requested = self.pending.pop(step)
        return self.received.pop(step), self.versions.pop(step, requested)

    def receive_until(self, step: int) -> None:
        while step not in self.received:
            kind, done_step, state = self.link.receive(self.server)
            if kind != ROLLOUT:
                raise CohortError(f"rank {self.rank}: expected a rollout from sampling rank {self.server}, got {kind!r}")
            if "pool" in state:  # partial rollouts
                self.versions[done_step], self.pool = state.pop("version"), state.pop("pool")
            self.received[done_step] = Batch.from_state(state)

    def steps_ahead(self, step: int) -> list[int]:
        return steps_to_start(step, self.lag, bool(self.pending))

    def prompt_batches(self) -> int:
        """Batches of prompts the next request carries: 2 for the first one with partial rollouts (the groups
        in flight beyond a step's), else 1."""
        return 2 if self.partial and self.pool is None and not self.pending else 1

    def sampled_ahead(self) -> None:
        """None: what the sampling ranks hold at a step's end (the pool of groups in flight) is not noted, so a
        failure in the next step cannot write that step's checkpoint."""
        return None

    def state_dict(self, noted: None = None) -> dict:
        """The rollouts requested and not yet trained on (waited for), and with partial rollouts the sampling
        rank's pool after them, for a checkpoint."""
        if self.pending:
            self.receive_until(max(self.pending))
        return {"pending": [{"step": step, "version": self.versions.get(step, version),
                             **self.received[step].state()} for step, version in sorted(self.pending.items())],
                "pool": self.pool}

    def load_state_dict(self, state: dict) -> None:
        """The rollouts a checkpoint saved, as if just received; the sampling rank gets its pool back."""
        for item in state.get("pending", []):
            self.received[item["step"]] = Batch.from_state(item)
            self.pending[item["step"]] = item["version"]
        if self.partial and state.get("pool") is not None:
            self.pool = state["pool"]
            self.link.send((RESTORE, self.pool), self.server)

    def close(self) -> None:
        """Tell the sampling rank this trainer is done; wait until what it sent has gone. Once only. The rollouts
        requested and not trained on (a run stopped early) are received first: the sampling rank's sends of them
        complete only then."""
        if not self.closed:
            self.closed = True
            if self.pending:
                self.receive_until(max(self.pending))
            self.link.send((STOP,), self.server)
            self.link.flush()


class RolloutServer:
    """A sampling rank's loop: requests in, rollouts out, weights loaded per policy version.

    policy: this rank's copy of the model (the engine samples it); sample: `(rows, seed, sequence_offset)
    -> Batch` over it; group_size: G. merge_requests: sample the requests of one step from all the trainers this rank
    serves in one engine call (their completions are consecutive in the step's batch, `Placement`): the
    call then waits once for the step's longest completion, not once per trainer. The engine keys its
    noise by each completion's index in the step's batch, so the tokens are those of separate calls.
    partial: `PartialRollouts`: each step's requests of all the trainers served go into one call over their
    pools of groups in flight (cohort_grpo/rollout/partial.py)."""

    def __init__(self, link, policy: torch.nn.Module, sample: Callable[..., Batch], group_size: int = 1,
                 merge_requests: bool = False, partial: PartialRollouts | None = None, shard_layout=None):
        self.link, self.policy, self.sample = link, policy, sample
        self.shard_layout = shard_layout  # `policy` is a tensor-parallel shard: the whole model's tensors
        self.group_size, self.merge_requests, self.partial = group_size, merge_requests, partial
        placement = link.placement
        self.trainers = placement.served_by(link.rank)
        # A tensor-parallel group (Placement): the leader reads the trainers' messages and relays each to the
        # other ranks, which read them from the leader; every rank then makes the same engine calls, and only
        # the leader replies.
        group = placement.group_of(link.rank)
        self.leader = group[0]
        self.followers = group[1:] if self.leader == link.rank else []
        self.pools = {t: GroupPool() for t in self.trainers}
        self.version: int | None = None
        self.served = 0

    def next_request(self, trainer: int):
        """The next request of `trainer`, after putting back the pool a resumed trainer returns."""
        while True:
            if self.leader == self.link.rank:
                message = self.link.receive(trainer)
                for follower in self.followers:
                    self.link.send(message, follower)
            else:
                message = self.link.receive(self.leader)
            if message[0] != RESTORE:
                return message
            self.pools[trainer] = GroupPool.from_state(message[1])

    def reply(self, message, trainer: int) -> None:
        """Send `message` to `trainer`: the leader of a group does; the other ranks sampled the same."""
        if self.leader == self.link.rank:
            self.link.send(message, trainer)
        self.served += 1

    def serve(self) -> int:
        """Serve until every trainer has stopped; the number of rollouts sampled."""
        live = list(self.trainers)
        while live:
            requests = {t: self.next_request(t) for t in live}
            live = [t for t in live if requests[t][0] != STOP]
            if self.partial is not None and live:
                self.serve_partial(live, requests)
                continue
            for trainers in self.engine_calls(live, requests):
                _, step, version, _, seed, sequence_offset = requests[trainers[0]]
                synced = self.use_weights_of(version)
                blocks = [requests[t][3] for t in trainers]
                batch = self.sample([row for block in blocks for row in block], seed, sequence_offset)
                for trainer, part in zip(trainers, split_by_blocks(batch, [len(block) for block in blocks])):
                    part.rollout_metrics = {**(part.rollout_metrics or {}), "time/weight_sync": synced}
                    self.reply((ROLLOUT, step, part.state()), trainer)  # the engine's rollouts are on the CPU
        self.link.flush()
        return self.served

    def engine_calls(self, trainers: list[int], requests: dict) -> list[list[int]]:
        """The trainers whose requests each engine call samples: all of them in one call when their requests
        are for the same step, version and seed and their completions follow each other in the batch."""
        if not self.merge_requests or len(trainers) < 2:
            return [[t] for t in trainers]
        first, expected = requests[trainers[0]], requests[trainers[0]][5]
        for trainer in trainers:
            _, step, version, rows, seed, offset = requests[trainer]
            if (step, version, seed, offset) != (first[1], first[2], first[4], expected):
                return [[t] for t in trainers]
            expected = offset + len(rows) * self.group_size
        return [trainers]

    def serve_partial(self, trainers: list[int], requests: dict) -> None:
        """One call over the pools of `trainers` (their requests are for the same step, version and seed)."""
        _, step, version, _, seed, _ = requests[trainers[0]]
        synced = self.use_weights_of(version)
        pools = [self.pools[t] for t in trainers]
        results = self.partial(pools, [requests[t][3] for t in trainers], step, version, seed)
        for trainer, pool, (batch, oldest, _) in zip(trainers, pools, results):
            batch.rollout_metrics = {**(batch.rollout_metrics or {}), "time/weight_sync": synced}
            self.reply((ROLLOUT, step, {**batch.state(), "version": oldest, "pool": pool.state_dict()}), trainer)

    @torch.no_grad()
    def use_weights_of(self, version: int) -> float:
        """The policy after `version` updates in this rank's copy: rank 0 broadcasts each version once, when the
        first request that needs it is served. Returns the seconds it took (0.0 when the copy had it), which the
        rollout carries to the step record as `time/weight_sync`."""
        if version == self.version:
            return 0.0
        started = time.perf_counter()
        if self.shard_layout is None:
            self.link.receive_weights(list(self.policy.state_dict().values()), version)
        else:  # each whole tensor in turn, this rank's slice of it copied into the shard in place
            update_shard_(self.policy, self.link.weights_one_by_one(self.shard_layout, self.policy.device, version))
        self.version = version
        device = getattr(self.policy, "device", None)  # a user's plain nn.Module may have none
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies into the weights are part of the sync
        return time.perf_counter() - started


def split_by_blocks(batch: Batch, prompts: list[int]) -> list[Batch]:
    """One rollout per block of `prompts[i]` consecutive prompts, each as sampling it alone gives."""
    if len(prompts) == 1:
        return [batch]
    group_size = len(batch.rows) // sum(prompts)
    parts, start = [], 0
    for count in prompts:
        parts.append(without_extra_padding(select_groups(batch, list(range(start, start + count)), group_size)))
        start += count
    return parts
