"""Asynchronous rollouts: the rollout of a later step is sampled while the update of this one trains.

In synchronous GRPO the sampler waits for the update and the update for the sampler. Here a producer
thread samples on its own copy of the policy (π_sampler), `max_staleness` = L updates behind: the rollout
of step t is sampled from the weights after update t − 1 − L, and it starts as soon as those exist, so it
runs while steps t − L … t − 1 score, compute log-probs and update. Which weights sample which step is
fixed by that schedule, never by thread timing, so a run is as reproducible as a synchronous one (the
same seed gives the same run, busy machine or not).

The update then trains on samples up to L policy versions old. The trainer weighs each token by
π_θ / π_sampler (the sampler correction, truncated at `importance_sampling_clip_max`: Yao et al. 2025,
truncated importance sampling), computed from the log-probs the sampler recorded, so the gradient stays
that of the current policy's objective; the step logs the log-prob gap and the ratios, and how stale
its samples were (`async/staleness`).

Each submitted rollout carries its own snapshot of the weights it must be sampled from (L + 1 snapshots
at most), loaded into the sampler's copy by the producer just before it samples.

Under FSDP2 the engine samples from a copy of its own anyway (the whole model, or the rank's tensor-parallel
shard), which the trainer rewrites in place after each update (`EngineCopy.refresh`). With L = 1
the producer samples on that copy itself, with no snapshot and no second copy: after update t the trainer
waits for the rollout the producer is sampling (`wait_idle`: step t + 1's, from the weights after update
t − 1, which the next step takes anyway), refreshes the copy to the weights after update t, and submits step
t + 2's. The schedule, and so the run, is the one above; the memory is one copy of the weights, not L + 2.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.rollout.batch import Batch


def weights_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the policy's weights as they are now (the version a rollout must be sampled from)."""
    with torch.no_grad():
        return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def steps_to_start(step: int, max_staleness: int, anything_pending: bool) -> list[int]:
    """The steps whose rollouts start after update `step`: at the start (nothing pending) L + 1 of them,
    all from the current weights; after every later update one, step + 1 + L."""
    if not anything_pending:
        return list(range(step + 1, step + 2 + max_staleness))
    return [step + 1 + max_staleness]


class AsyncRollouts:
    """Rollouts sampled ahead on a producer thread, on a copy of the policy.

    sampler_policy: the policy's copy the producer samples with (its weights are replaced per rollout), or None:
    the producer samples on the engine's own copy, which the trainer refreshes in place between rollouts
    (FSDP2; `wait_idle` before each refresh; L = 1).
    sample: `(rows, seed, sequence_offset) -> Batch` over that copy (a GroupSampler on its engine).
    max_staleness: L, how many updates behind the policy the samples are.
    """

    def __init__(self, sampler_policy: torch.nn.Module | None, sample, max_staleness: int):
        if max_staleness < 1:
            raise CohortError(f"max_staleness={max_staleness}: asynchronous rollouts need at least 1 (0 is the "
                              "synchronous loop: leave --async_rollouts off)")
        if sampler_policy is None and max_staleness != 1:
            raise CohortError(f"max_staleness={max_staleness} with FSDP2's asynchronous rollouts: the engine samples "
                              "on the one copy the trainer refreshes after each update, so it is 1 update behind; "
                              "pass --max_staleness 1, or --rollout_gpus K to sample on ranks of their own")
        self.policy, self.sample, self.max_staleness = sampler_policy, sample, max_staleness
        self.producer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cohort-rollouts")
        self.pending: dict[int, tuple[Future, int]] = {}  # step -> (its batch, the policy version it samples)

    @property
    def in_place(self) -> bool:
        """Whether the producer samples on the engine's own copy, which the trainer refreshes in place."""
        return self.policy is None

    def snapshot(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The weights the rollouts submitted now must be sampled from (in place: already in the engine's copy)."""
        return None if self.in_place else weights_snapshot(model)

    def submit(self, step: int, version: int, weights: dict[str, torch.Tensor] | None, rows: list[dict], seed: int,
               sequence_offset: int) -> None:
        """Queue the rollout of `step`, sampled from `weights` (the policy after `version` updates; None: the
        engine's copy as the trainer left it)."""
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def job() -> Batch:
            if device is not None:  # a thread starts on GPU 0, whatever the rank's GPU
                torch.cuda.set_device(device)
            if weights is not None:
                with torch.no_grad():
                    self.policy.load_state_dict(weights)
            return self.sample(rows, seed, sequence_offset)

        self.pending[step] = (self.producer.submit(job), version)

    def wait_idle(self) -> None:
        """Wait until no rollout reads the engine's copy (before the trainer rewrites it, or samples on the same
        engine itself). Only in place: a producer with its own copy is never in the way."""
        for future, _ in self.pending.values():
            future.exception()  # waits; a failure is raised where the step takes its rollout

    def take(self, step: int) -> tuple[Batch, int]:
        """The rollout of `step` (waiting for it if it is still being sampled) and its policy version."""
        if step not in self.pending:
            raise CohortError(f"no asynchronous rollout was started for step {step}")
        future, version = self.pending.pop(step)
        return future.result(), version

    def steps_ahead(self, step: int) -> list[int]:
        """The steps whose rollouts start after update `step` (`steps_to_start`)."""
        return steps_to_start(step, self.max_staleness, bool(self.pending))

    def prompt_batches(self) -> int:
        """Batches of prompts each submission carries (partial rollouts, on sampling ranks only, want more)."""
        return 1

    def state_dict(self, noted: dict | None = None) -> dict:
        """The rollouts sampled ahead (waited for), as plain values, so a checkpoint resumes exactly: they
        were drawn from the data stream and the weights the checkpoint has already moved past. `noted`: those
        `sampled_ahead` noted earlier (None: those pending now)."""
        pending = self.pending if noted is None else noted
        return {"pending": [{"step": step, "version": version, **future.result().state()}
                            for step, (future, version) in sorted(pending.items())]}

    def sampled_ahead(self) -> dict:
        """The rollouts pending now (the batches to come), not waited for: a step that takes one and then fails can
        still save them as they were at the end of the step before."""
        return dict(self.pending)

    def load_state_dict(self, state: dict) -> None:
        """Put back the rollouts a checkpoint saved, as if just sampled."""
        for item in state.get("pending", []):
            done: Future = Future()
            done.set_result(Batch.from_state(item))
            self.pending[item["step"]] = (done, item["version"])

    def close(self) -> None:
        """Wait for what is being sampled and stop the producer."""
        self.producer.shutdown(wait=True, cancel_futures=True)
        self.pending.clear()
