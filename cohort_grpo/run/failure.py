"""A run that fails mid-step keeps its last completed step.

An exception out of the training loop — a reward function's, a tool's, a bad row's, a CUDA error, an out-of-memory
that could not be recovered — loses nothing once a step has completed: `RunLifecycle.__exit__` writes
checkpoint-<step> of the last completed step and the error's one line says where it is. The weights and the
optimizer's state are that step's until the failing step's first optimizer step (`PolicyUpdate.optimizer_steps`);
what the failing step moved before it — the RNG states, the data position, the logs' ends, the rollouts sampled
ahead (the failing step's own among them) — is put back from `StepEnd`, noted in memory at each step's end. A
failure after the weights changed, or with rollouts sampled ahead that could not be noted (on sampling ranks), writes
nothing: its line names the newest checkpoint there is instead.

Several ranks save together (the save is a collective), so a checkpoint is written only when every rank failed
alike: a failure while scoring is made every rank's (`fail_together`); any other failure on one rank writes
nothing, and the job ends as it did before (docs/howto/resume.md).
"""

from __future__ import annotations

import contextlib
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from cohort_grpo.errors import CohortError, in_front_end_words
from cohort_grpo.parallel.faults import RELAYED, first_line
from cohort_grpo.rewards.user_calls import exception_line
from cohort_grpo.run.checkpoint import RunState, check_checkpoint, list_checkpoints, log_sizes, random_state

RESUME_HINT = "continue the run with --resume"


@dataclass
class StepEnd:
    """A run at the end of a step, as a checkpoint written later needs it: its plain values (`RunState`, with the
    RNG states and the logs' sizes), the reward functions then (a curriculum stage may swap them), the optimizer
    steps taken so far (`PolicyUpdate.optimizer_steps`), the rollouts sampled ahead then (`RolloutSource.sampled_ahead`,
    None: none), and why a checkpoint of it would not resume exactly (None: it would)."""

    state: RunState
    reward_funcs: list
    optimizer_steps: int
    inexact: str | None = None
    sampled_ahead: dict | None = None


class TrainingFailed(CohortError):
    """A `CohortError` raised during training, its line extended by where the run is kept. `checkpoint`: the folder
    to continue from (the last completed step's, or an older one), None when there is none; `step`: the step
    that failed."""

    def __init__(self, message: str, checkpoint: Path | None, step: int | None):
        super().__init__(message)
        self.checkpoint, self.step = checkpoint, step


def note_step_end(state: RunState, out: Path, reward_funcs: list, optimizer_steps: int, async_rollouts: bool,
                  sampled_ahead: dict | None = None) -> StepEnd:
    """The run at the end of a step (its plain values `state`), noted in memory with the RNG states and the logs'
    sizes in `out` for a checkpoint that a failure in the next step writes, with the rollouts sampled ahead then
    (`sampled_ahead`); with `async_rollouts` and none noted (sampling ranks), it cannot be put back to them."""
    state.random, state.file_sizes = random_state(), log_sizes(out)
    unnoted = async_rollouts and sampled_ahead is None
    inexact = "the rollouts sampled ahead (--async_rollouts) have moved past it" if unnoted else None
    return StepEnd(state, list(reward_funcs), optimizer_steps, inexact, sampled_ahead)


def discard_unused_output_dir(out: Path, *, made_by_run: bool, step_done: bool,
                              close_logs: Callable[[], None] | None) -> None:
    """Remove `out` when this run made it (`made_by_run`) and failed before finishing a step, its logs closed
    first (`close_logs`, None before they are open)."""
    if not made_by_run or step_done:
        return
    if close_logs is not None:
        close_logs()
    shutil.rmtree(out, ignore_errors=True)


def saved_line(folder: Path) -> str:
    return f"{folder.name} saved in {folder.parent} — {RESUME_HINT}"


def newest_line(out: Path, why: str, newest: Path | None) -> str:
    """No checkpoint of the last step (`why`): the newest there is (`newest`, from `newest_checkpoint`), or that
    there is none."""
    if newest is not None:
        return f"{why}; the newest checkpoint is {newest.name} in {out} — {RESUME_HINT}"
    return f"{why}; no checkpoint exists, the run starts again from step 0"


def checkpoint_marks(out: Path) -> dict[str, int]:
    """Each checkpoint folder in `out` now, with its modification time (ns): what `out` held when a job started,
    for `job_checkpoint`."""
    marks = {}
    for folder in list_checkpoints(out):
        with contextlib.suppress(OSError):
            marks[folder.name] = folder.stat().st_mtime_ns
    return marks


def job_checkpoint(out: Path, before: dict[str, int], resuming: bool) -> Path | None:
    """The newest complete checkpoint in `out` that --resume continues a stopped job from, for a job that started
    when `out` held `before` (`checkpoint_marks`): any, when the job resumed (the one it continued is still
    there); else one the job wrote. None: the job kept nothing to continue from (it stopped before its first
    save; a finished run's checkpoints that it did not get to replace are not its own)."""
    for folder in reversed(list_checkpoints(out)):
        with contextlib.suppress(OSError):
            written = before.get(folder.name) != folder.stat().st_mtime_ns
            if (resuming or written) and check_checkpoint(folder, hashes=False) is None:
                return folder
    return None


def newest_checkpoint(out: Path) -> Path | None:
    complete = [f for f in list_checkpoints(out) if check_checkpoint(f, hashes=False) is None]
    return complete[-1] if complete else None


def with_hint(error: Exception, hint: str, checkpoint: Path | None, step: int | None) -> Exception:
    """What `train()` raises for `error` once the run is kept: a `CohortError`'s line with `hint` appended (a
    `TrainingFailed`); any other exception itself — a caller's `except ValueError:` still catches it — with
    `checkpoint`, `failed_step` and `resume_hint` set and the hint as a note under its traceback. The command line
    prints either as one line (`failure_line`)."""
    if isinstance(error, CohortError):
        text = " ".join(Exception.__str__(error).split("\n"))  # the command line's words: rewritten when shown
        return TrainingFailed(f"{text}; {hint}", checkpoint, step)
    error.checkpoint, error.failed_step, error.resume_hint = checkpoint, step, hint
    error.add_note(f"cohort: {in_front_end_words(hint)}")
    return error


def failure_line(error: BaseException) -> str | None:
    """The one line the command line prints for an exception `with_hint` kept the run of (None for any other):
    the exception's type, first line and innermost place, then where the run is."""
    hint = getattr(error, "resume_hint", None)
    if hint is None:
        return None
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    step = getattr(error, "failed_step", None)
    failed = f"step {step} failed" if step is not None else "training failed"
    # the first line: a CUDA error's says what failed, its last how to debug it
    return f"{failed}: {type(error).__name__}: {first_line(error)}{where}; {hint}; --debug shows the traceback"


@contextlib.contextmanager
def fail_together(parallel, what: str) -> Iterator[None]:
    """Around a stage every rank runs each step (scoring): when it raises on any rank, it raises on every rank,
    and every rank's exception is marked `every_rank`, so that they all write the failure checkpoint together.
    One all-reduce a step with several ranks; nothing with one."""
    failure = None
    try:
        yield
    except Exception as error:  # noqa: BLE001 - told to the other ranks, then raised here
        failure = error
    if parallel.world_size > 1 and parallel.any(failure is not None):
        lines = parallel.gather_objects(None if failure is None else exception_line(failure))
        if failure is None:
            rank, line = next((r, line) for r, line in enumerate(lines) if line is not None)
            failure = CohortError(f"{RELAYED} {rank}, which failed {what} ({line})")
        failure.every_rank = True
    if failure is not None:
        raise failure


def keep_failed_run(error: Exception, *, last: StepEnd | None, now: Callable[[], StepEnd] | None,
                    save_once: Callable[[int, StepEnd], Path], out: Path, world_size: int,
                    resumed_from: Path | None = None) -> Exception | None:
    """The exception `train()` raises for `error` after writing the failure checkpoint it can (see the module
    docstring); None: `error` as it is (no step completed, or one rank alone failed among several).
    `resumed_from`: the checkpoint this attempt resumed from, the last completed step until one completes."""
    if now is None or (world_size > 1 and not getattr(error, "every_rank", False)):
        return None
    if last is None:  # no step completed in this attempt: the checkpoint it resumed from holds the last one
        if resumed_from is None:
            return None
        hint = saved_line(resumed_from) if resumed_from.parent.resolve() == out.resolve() else newest_line(
            out, f"the run resumed from {resumed_from}", newest_checkpoint(out))
        return with_hint(error, hint, resumed_from, None)
    step = last.state.step

    def kept_elsewhere(why: str) -> Exception:
        newest = newest_checkpoint(out)
        return with_hint(error, newest_line(out, why, newest), newest, step + 1)

    if now().optimizer_steps != last.optimizer_steps:
        return kept_elsewhere(f"no checkpoint of step {step} could be written: the failure came after step "
                              f"{step + 1} changed the weights")
    if last.inexact is not None:
        return kept_elsewhere(f"no checkpoint of step {step} could be written: {last.inexact}")
    try:
        folder = save_once(step, last)
    except Exception as save_error:  # noqa: BLE001 - the training error stays the one raised
        return kept_elsewhere(f"writing checkpoint-{step} failed too ({exception_line(save_error)})")
    return with_hint(error, saved_line(folder), folder, step + 1)
