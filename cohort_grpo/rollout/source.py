"""Where a step's rollout comes from: one interface for every way a run samples, so the loop never asks which.

Algorithm 1 says "π_old ← π_θ; sample G outputs from π_old". A run may do that at the step itself, on this rank's
engine (`SampleNow`), or ahead, `max_staleness` updates behind the trained policy (`SampledAhead`): on a producer
thread of this rank, over a copy of the policy or in place on the engine's own copy (`AsyncRollouts`,
cohort_grpo/rollout/async_rollouts.py), or on sampling ranks of their own (`RemoteRollouts`, cohort_grpo/rollout/remote.py).
The training ranks of the colocated placement sample in tensor-parallel groups (cohort_grpo/rollout/colocated.py) in
either way. The trainer sees a `RolloutSource` only:

- `take(step)`: the step's batch, sampled now or ahead (waiting for it);
- `after_update(model)`: what follows the optimizer step: under FSDP2 the engine's copy of the weights (the whole
  model or this rank's tensor-parallel shard, `EngineCopy`) refreshed from the trained shards, then the rollouts
  that must be sampled from the updated weights started (to the sampling ranks with the weights they need);
- `sample(rows)`: rows sampled now on this rank's engine (dynamic sampling's extra rounds, the reward models'
  warm-up); `wait_for_engine()`: before the trainer evaluates on that engine;
- `state_dict()` / `load_state_dict()`: the rollouts sampled ahead, which a checkpoint keeps (trainer_extra.pt);
  `sampled_ahead()` notes them as they stand at a step's end (not waited for), and `state_dict()` inside
  `as_of(noted)` gives them as noted then (the checkpoint of that step, written after the next step failed);
- `close()`: the producer thread stops, or the sampling ranks are told this trainer is done.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

from torch import nn

from cohort_grpo.parallel.distributed import Parallel
from cohort_grpo.parallel.engine_copy import EngineCopy
from cohort_grpo.rollout.batch import Batch
from cohort_grpo.rollout.sampler import Sampler

if TYPE_CHECKING:
    from cohort_grpo.memory.manager import MemoryManager
    from cohort_grpo.rollout.async_rollouts import AsyncRollouts
    from cohort_grpo.rollout.group_sampler import GroupSampler
    from cohort_grpo.rollout.remote import RemoteRollouts


class Phases(Protocol):
    """What times the step's phases (the step report): `phase(name)` around each."""

    def phase(self, name: str) -> AbstractContextManager[None]: ...


class RolloutSource(Protocol):
    """Where a trainer rank's rollouts come from (see the module docstring)."""

    sampler: Sampler | None  # the engine this rank samples the step's rollouts with (None: sampling ranks do)

    def take(self, step: int) -> Batch: ...

    def after_update(self, model: nn.Module) -> None: ...

    def sample(self, rows: list[dict]) -> Batch: ...

    def wait_for_engine(self) -> None: ...

    def state_dict(self) -> dict | None: ...

    def load_state_dict(self, state: dict) -> None: ...

    def sampled_ahead(self) -> dict | None: ...

    def as_of(self, noted: dict | None) -> AbstractContextManager[None]: ...

    def close(self) -> None: ...


class SampleNow:
    """Each step's rollout sampled when the step takes it, on this rank's engine over π_θ as it is: the synchronous
    loop.

    group_sampler: Algorithm 1's sampling stage over the engine; memory: the run's `MemoryManager` (π_ref back to
    the device while the engine samples, the engine's memory released after it); phases: the step report.
    next_rows(): this rank's block of the next prompt batch (the trainer's: a curriculum switches stages there);
    next_seed(): the next sampling seed of the run's prompt stream. sequence_offset: the global index of this
    rank's first completion in a step's batch, which keys its sampling noise, so that several ranks draw what one
    would. engine_copy: under FSDP2, the engine's copy of the weights, refreshed after each update; None where the
    engine samples the trained weights themselves."""

    def __init__(self, group_sampler: GroupSampler, *, memory: MemoryManager, phases: Phases,
                 next_rows: Callable[[], list[dict]], next_seed: Callable[[], int], sequence_offset: int = 0,
                 engine_copy: EngineCopy | None = None):
        self.group_sampler, self.memory, self.phases = group_sampler, memory, phases
        self.next_rows, self.next_seed, self.sequence_offset = next_rows, next_seed, sequence_offset
        self.engine_copy = engine_copy

    @property
    def sampler(self) -> Sampler:
        return self.group_sampler.sampler

    def take(self, step: int) -> Batch:
        """π_old ← π_θ (the engine reads the current weights); G completions for each of the next prompts."""
        rows = self.next_rows()
        with self.phases.phase("sampling"):
            return self.sample(rows)

    def sample(self, rows: list[dict]) -> Batch:
        self.memory.before_sampling()  # π_ref's weights head back to the GPU while the engine samples
        batch = self.group_sampler(rows, seed=self.next_seed(), sequence_offset=self.sequence_offset)
        self.memory.after_sampling()
        return batch

    def after_update(self, model: nn.Module) -> None:
        """FSDP2: the updated shards into the copy (or tensor-parallel shard) the engine samples."""
        if self.engine_copy is not None:
            with self.phases.phase("gather"):
                self.engine_copy.refresh()

    def wait_for_engine(self) -> None:
        """Nothing else samples on this rank's engine."""

    def state_dict(self) -> dict | None:
        return None  # nothing sampled ahead

    def load_state_dict(self, state: dict) -> None:
        pass

    def sampled_ahead(self) -> dict | None:
        return None

    def as_of(self, noted: dict | None) -> AbstractContextManager[None]:
        return nullcontext()

    def close(self) -> None:
        pass


class SampledAhead:
    """Each step's rollout sampled ahead by `ahead` (an `AsyncRollouts` or `RemoteRollouts`), from the policy of
    `max_staleness` updates ago: the rollout of step t is started once update t − 1 − L exists, so it overlaps
    the updates between (async_rollouts.py tells the schedule).

    now: this rank's own sampling (`SampleNow`: the trainer's extra rounds, and under FSDP2 the engine's copy it
    refreshes); policy: π_θ, whose weights the first rollouts are sampled from; parallel: the training ranks (a
    checkpoint holds every rank's rollouts); max_steps: the run's last step; sampler: the engine that samples the
    rollouts on this rank (None: on sampling ranks); log: where a resume that cannot continue exactly says so.

    past_end: the rollouts of the steps after max_steps that a longer run would start from the policy before its
    last update are started too, so that the last step's checkpoint holds them and a resume with a larger max_steps
    trains what the longer run trains (False: nothing starts beyond max_steps, as when no checkpoint is written
    there). They cost the sampling of max_staleness rollouts that overlap the last updates."""

    def __init__(self, ahead: AsyncRollouts | RemoteRollouts, now: SampleNow, *, policy: nn.Module,
                 parallel: Parallel, max_steps: int, sampler: Sampler | None = None, past_end: bool = True,
                 log: Callable[[str], None] = print):
        self.ahead, self.now, self.policy, self.parallel = ahead, now, policy, parallel
        self.max_steps, self.sampler, self.past_end, self.log = max_steps, sampler, past_end, log
        self.step = 0  # the step last taken: the policy's version once it is updated
        self.noted: dict | None = None  # what `state_dict` gives inside `as_of`; None: the rollouts as they are

    def take(self, step: int) -> Batch:
        """The rollout of `step` and how stale it is (`async/staleness`). The first one taken (of a run, or of a
        resumed run whose checkpoint kept none, which says so) starts the first L + 1 from the weights as they are; the
        first one after a resume from the last step of a run starts the one its last update would have."""
        if not self.ahead.pending:
            if step > 1:
                self.log(self.inexact_resume_line(step))
            self.start(step - 1, self.policy)
        elif any(ahead not in self.ahead.pending for ahead in self.ahead.steps_ahead(step - 1)):
            self.start(step - 1, self.policy)  # what the update of the checkpoint's step started in a longer run
        self.step = step
        with self.now.phases.phase("sampling"):  # only the wait: the sampling itself overlapped earlier steps
            batch, version = self.ahead.take(step)
        batch.rollout_metrics = {**(batch.rollout_metrics or {}), "async/staleness": float(step - 1 - version)}
        return batch

    def after_update(self, model: nn.Module) -> None:
        """The engine's copy refreshed (FSDP2; in place, once the rollout it is sampling is done), then the
        rollouts that must start from the updated weights."""
        if self.now.engine_copy is not None:
            self.wait_for_engine()  # the copy the refresh rewrites may be sampling the next step's rollout
        self.now.after_update(model)
        self.start(self.step, model)

    def start(self, version: int, model: nn.Module) -> None:
        """Start sampling, from `model`'s weights as they are now (the policy after `version` updates), the
        rollouts of the steps that must use them: the first L + 1 at the start, then one per update."""
        steps = [ahead for ahead in self.ahead.steps_ahead(version)
                 if ahead <= self.max_steps or (self.past_end and version < self.max_steps)]
        if not steps:
            return
        weights = self.ahead.snapshot(model)
        for ahead in steps:  # partial rollouts: the first request brings the groups in flight beyond a step's
            rows = [row for _ in range(self.ahead.prompt_batches()) for row in self.now.next_rows()]
            self.ahead.submit(ahead, version, weights, rows, self.now.next_seed(), self.now.sequence_offset)

    def inexact_resume_line(self, step: int) -> str:
        lag = len(self.ahead.steps_ahead(step - 1)) - 1  # L + 1 rollouts start at once
        rollouts = f"step {step}'s rollout is" if lag == 1 else f"the rollouts of steps {step}-{step + lag - 1} are"
        return (f"asynchronous rollouts: the checkpoint of step {step - 1} holds no rollouts sampled ahead, so "
                f"{rollouts} sampled from its weights, not from those max_staleness={lag} updates before: the resumed "
                f"run differs from an uninterrupted one from step {step} on")

    def sample(self, rows: list[dict]) -> Batch:
        self.wait_for_engine()
        return self.now.sample(rows)

    def wait_for_engine(self) -> None:
        """Rollouts sampled on the engine's own copy (FSDP2, in place): the trainer's own use of that engine, or a
        rewrite of its weights, waits for the rollout it is sampling."""
        if self.ahead.in_place:
            with self.now.phases.phase("sampling"):
                self.ahead.wait_idle()

    def state_dict(self) -> dict:
        """Every rank samples its own block of each step: all ranks' rollouts sampled ahead, gathered (a collective,
        on every rank) for rank 0 to write."""
        return {"async_rollouts": self.parallel.gather_objects(self.ahead.state_dict(self.noted))}

    def sampled_ahead(self) -> dict | None:
        """The rollouts sampled ahead as they stand now, not waited for (None where they cannot be noted)."""
        return self.ahead.sampled_ahead()

    @contextmanager
    def as_of(self, noted: dict | None) -> Iterator[None]:
        """Inside, `state_dict` gives the rollouts `sampled_ahead()` noted (None: as they are)."""
        self.noted = noted
        try:
            yield
        finally:
            self.noted = None

    def load_state_dict(self, state: dict) -> None:
        """This rank's rollouts of what `state_dict` saved; without them (another layout of ranks) the first step
        samples them again from the loaded weights."""
        by_rank = state.get("async_rollouts")
        if by_rank and len(by_rank) == self.parallel.world_size:
            self.ahead.load_state_dict(by_rank[self.parallel.rank])

    def close(self) -> None:
        """The producer thread stops (with what it was sampling), or the sampling ranks are told this trainer is
        done. Once or more."""
        self.ahead.close()
