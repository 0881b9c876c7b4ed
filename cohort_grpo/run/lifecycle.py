"""`RunLifecycle`: the run around its checkpoints, so that a run is never lost.

Before any heavy work the output folder is checked (a folder, writable: `check_output_dir`); when
training starts, once `train(resume_from_checkpoint=...)` said whether the run resumes (`resuming`), an
earlier run there is not overwritten by accident (`claim_output_dir`). `train()` runs inside
`with RunLifecycle(...)`: on entry SIGINT / SIGTERM are caught (`StopRequest`); `resume` loads a checkpoint
when asked (`--resume`); after each step `end_of_step` saves one when due, and on a signal or too many
non-finite updates in a row saves and stops (`TrainingInterrupted`, `CohortError`). On exit, also when
training raises, the previous signal handlers are back; a run that ended says in one line where it is, and a
run that failed after a completed step keeps that step in a checkpoint and says so in its error's line
(`failure.py`). The checkpoint folder format itself is `checkpoint.py` (writing, verifying) and
`checkpoint_load.py` (reading). docs/howto/resume.md tells the whole story.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import time
import threading
from pathlib import Path
from typing import Callable

from cohort_grpo.errors import CohortError, in_front_end_words
from cohort_grpo.telemetry.metrics import COMPLETIONS_FILE, METRICS_FILE
from cohort_grpo.run.checkpoint import (RunParts, RunState, check_checkpoint, list_checkpoints, newest_complete, remove_leftovers,
                         truncate_logs)
from cohort_grpo.run.checkpoint_load import checkpoint_step, ends_its_run, load_checkpoint
from cohort_grpo.run.failure import StepEnd, TrainingFailed, keep_failed_run


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM arrived; a checkpoint was saved. The CLI exits with 128 + the signal number.

    A KeyboardInterrupt, raised out of `train()` once the checkpoint is written: what a script gets from
    Ctrl-C under TRL too, so its own `except KeyboardInterrupt:` runs, and the code after `train()` (saving
    the "final" model, pushing it) does not run on a half-trained policy as if training had ended. Not caught,
    it ends the script as it ends `cohort-grpo train`: its one line, exit status 128 + the signal, no traceback
    (`end_uncaught_stops_in_one_line`)."""

    def __init__(self, signum: int, checkpoint: Path, step: int):
        self.signum, self.checkpoint = signum, checkpoint
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint "
                         f"saved in {checkpoint} — continue the run with --resume")

    def __str__(self) -> str:  # a script continues with resume=True
        return in_front_end_words(super().__str__())


def prepare_output_dir(args, log=print) -> None:
    """The whole check of `output_dir` for `args`: `check_output_dir`, then `claim_output_dir`."""
    check_output_dir(args)
    claim_output_dir(args, log)


def check_output_dir(args) -> None:
    """Before any heavy work: output_dir is a folder this process can write to (made if missing), the leftovers of
    killed writes are gone, and a checkpoint that `args.resume_from_checkpoint` names is complete."""
    out = Path(args.output_dir)
    file = next((path for path in (out, *out.parents) if path.exists() and not path.is_dir()), None)
    if file is not None:  # mkdir's "File exists" / "Not a directory" would read as a permission problem
        where = "is a file" if file == out else f"is inside {str(file)!r}, which is a file"
        raise CohortError(f"output_dir {str(out)!r} {where}, not a folder; name a folder (a new one is made), "
                          "or move the file away (--output_dir)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise CohortError(f"output_dir {str(out)!r} is not writable ({error.strerror or error}); choose a folder "
                          "you can write to (--output_dir)") from None
    if int(os.environ.get("RANK", "0")) == 0:  # several processes: rank 0 alone cleans and deletes
        remove_leftovers(out)
    if args.resume_from_checkpoint not in (None, "latest"):
        check_named_checkpoint(args.resume_from_checkpoint)


def check_named_checkpoint(folder) -> None:
    reason = check_checkpoint(Path(folder))
    if reason:
        raise CohortError(f"cannot resume from {folder}: it is {reason}; pass a complete checkpoint-<step> folder "
                          "or --resume to pick the newest complete one")


def resuming(args, resume_from_checkpoint=None):
    """`args` as `train(resume_from_checkpoint)` runs them, with transformers' meanings: True continues the newest
    complete checkpoint in output_dir (cohort's `resume`), a path that checkpoint folder; None or False leaves what
    `args.resume` / `args.resume_from_checkpoint` say. The copy stays read-only where `args` is."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return args
    if not isinstance(resume_from_checkpoint, (bool, str, os.PathLike)):
        raise CohortError(f"train(resume_from_checkpoint={resume_from_checkpoint!r}): pass True (the newest checkpoint "
                          "in output_dir), a checkpoint-<step> folder, or None")
    if args.overwrite_output_dir:
        raise CohortError("train(resume_from_checkpoint=...) and overwrite_output_dir=True contradict each other: "
                          "overwrite_output_dir deletes the checkpoints; drop one of the two")
    spec = "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
    if spec != "latest":
        check_named_checkpoint(spec)
    copy = dataclasses.replace(args, resume_from_checkpoint=spec)
    return copy.freeze() if getattr(args, "frozen", False) else copy


def claim_output_dir(args, log=print) -> None:
    """When training starts: an unfinished run in output_dir is not overwritten by accident (refused unless resuming
    or `overwrite_output_dir`, which deletes it); a finished one is replaced, as TRL does."""
    out = Path(args.output_dir)
    existing = list_checkpoints(out)
    if not existing or args.resume or args.resume_from_checkpoint:
        return
    # A finished run is replaced, as TRL writes over its output_dir; an unfinished one is what resume is for.
    finished = ends_its_run(existing[-1])
    if not (args.overwrite_output_dir or finished):
        raise CohortError(f"output_dir {str(out)!r} holds an unfinished run (newest: {existing[-1].name}); pass "
                          "--resume to continue it, --overwrite_output_dir to start over (deleting its "
                          "checkpoints), or choose another --output_dir")
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if args.overwrite_output_dir:
        log(f"overwrite_output_dir: removing {len(existing)} checkpoint(s) and the metrics of the earlier run in {out}")
    else:
        log(in_front_end_words(f"{out} holds a finished run (newest: {existing[-1].name}): a new run replaces it, "
                               f"as in TRL; removing its {len(existing)} checkpoint(s) and metrics (another "
                               "--output_dir keeps a run)"))
    for folder in existing:
        shutil.rmtree(folder)
    truncate_logs(out, {METRICS_FILE: 0, COMPLETIONS_FILE: 0}, log)


class RunLifecycle:
    """`with RunLifecycle(args, parallel, log) as run:` around the training loop.

    `save` writes a checkpoint of the run as it is now and returns its folder (`save(step_end)`: of the run
    as `step_end` noted it, with the weights as they are now); `close_logs` closes the metrics files and the
    display before a stop is raised; `step_end` notes the run as it is at a step's end (None: a failure keeps
    no checkpoint)."""

    def __init__(self, args, parallel, log: Callable[[str], None], save: Callable[..., Path],
                 close_logs: Callable[[], None], step_end: Callable[[], StepEnd] | None = None):
        self.args, self.parallel, self.log = args, parallel, log
        self.save, self.close_logs, self.step_end = save, close_logs, step_end
        self.stop = StopRequest()
        self.saved_step: int | None = None  # the step of the checkpoint written (or loaded) last
        self.last_step_end: StepEnd | None = None  # the last completed step, noted at its end
        self.resumed_from: Path | None = None  # the checkpoint this attempt continues

    def __enter__(self) -> "RunLifecycle":
        self.stop.install()
        return self

    def __exit__(self, kind, value, traceback) -> bool:
        self.stop.uninstall()  # SIGINT / SIGTERM back to their previous handlers, also when training raised
        if kind is None:
            out = self.args.output_dir
            self.log(f"run saved in {out}: the trained policy (a Hugging Face folder), metrics.jsonl, "
                     f"completions.jsonl; `cohort-grpo report {out}` draws it")
        elif isinstance(value, Exception) and not isinstance(value, TrainingFailed):  # not a stop of ours
            raised = keep_failed_run(value, last=self.last_step_end, now=self.step_end, save_once=self.save_once,
                                     out=Path(self.args.output_dir), world_size=self.parallel.world_size,
                                     resumed_from=self.resumed_from)
            if raised is not None:
                self.close_logs()
                if raised is not value:
                    raise raised from value
        return False

    def checkpoint_to_resume(self) -> Path | None:
        """The checkpoint --resume / resume_from_checkpoint names (the newest complete one for
        "latest"), the same on every rank; None to start from step 0."""
        args = self.args
        spec = args.resume_from_checkpoint or ("latest" if args.resume else None)
        if spec is None:
            return None
        out = Path(args.output_dir)
        parallel = self.parallel
        folder = newest_complete(out, self.log) if spec == "latest" and parallel.is_main else Path(spec)
        folder = parallel.broadcast_object(folder)  # rank 0 checked the hashes; every rank loads the same folder
        if folder is None:
            self.log(f"no complete checkpoint in {out}: starting the run from step 0")
            if parallel.is_main:
                truncate_logs(out, {METRICS_FILE: 0, COMPLETIONS_FILE: 0}, self.log)  # lines of no checkpoint
        return folder

    def resume(self, run_parts: Callable[[], RunParts], enter_stage: Callable[[int], None]) -> RunState | None:
        """Load `checkpoint_to_resume()` into the objects `run_parts()` gives, in place, and return the run's plain
        values; None to start from step 0. A checkpoint past step 0 first enters its curriculum stage
        (`enter_stage(step)`), so that the stage's rows and rewards are the ones whose state it restores."""
        folder = self.checkpoint_to_resume()
        if folder is None:
            return None
        step = checkpoint_step(folder)
        if step > 0:
            enter_stage(step)
        state = load_checkpoint(run_parts(), folder, self.log)
        self.resumed(folder, state.step)
        return state

    def resumed(self, folder: Path, step: int) -> None:
        self.saved_step, self.resumed_from = step, Path(folder)
        self.log(f"resumed from {folder} at step {step}")

    def end_of_step(self, step: int, nonfinite_in_a_row: int) -> None:
        """Save every save_steps and at the last step (none of these with save_strategy no); stop on a signal
        or on too many non-finite updates in a row, after saving, whatever save_strategy says, so nothing is lost."""
        args, stop, parallel = self.args, self.stop, self.parallel
        if parallel.world_size > 1:  # all ranks stop at the same step, or none does
            stop.signum = next((s for s in parallel.gather_objects(stop.signum) if s is not None), None)
        too_many_faults = nonfinite_in_a_row >= args.max_consecutive_nonfinite
        due = args.save_strategy != "no" and (
            (args.save_steps and step % args.save_steps == 0) or step == args.max_steps)
        if due or too_many_faults or stop.signum is not None:
            folder = self.save_once(step)
        if too_many_faults:
            self.close_logs()
            raise TrainingFailed(f"{nonfinite_in_a_row} updates in a row had a non-finite loss, gradient or log-prob (up to "
                              f"step {step}); stopped with the last finite weights in {folder}: lower --learning_rate, "
                              "lower --max_grad_norm, or check the reward functions for inf/NaN", folder, step)
        if stop.signum is not None:
            self.close_logs()
            end_uncaught_stops_in_one_line()
            raise TrainingInterrupted(stop.signum, folder, step)
        if self.step_end is not None:
            self.last_step_end = self.step_end()

    def save_once(self, step: int, step_end: StepEnd | None = None) -> Path:
        """checkpoint-<step>, unless this very step was saved already (a signal arrived on a save step, a failure
        came in the step after a save); `step_end`: of the run as noted then, not as it is now."""
        final = Path(self.args.output_dir) / f"checkpoint-{step}"
        if self.saved_step == step and check_checkpoint(final, hashes=False) is None:
            return final
        folder = self.save() if step_end is None else self.save(step_end)
        self.saved_step = step
        return folder


def end_uncaught_stops_in_one_line() -> None:
    """From now on, a `TrainingInterrupted` that no code catches ends the process as `cohort-grpo train` does: its
    one line on stderr (the first rank's) and exit status 128 + the signal, instead of a traceback and status 1
    (Python exits as Ctrl-C did only for a KeyboardInterrupt of that very class). Every other exception goes
    to the hook that was there; a hook that raises SystemExit sets the status, after the atexit handlers."""
    previous = sys.excepthook
    if getattr(previous, "ends_stops", False):
        return

    def hook(kind, value, traceback):
        if not isinstance(value, TrainingInterrupted):
            return previous(kind, value, traceback)
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank stops alike: rank 0 says so
            print(f"cohort: {value}", file=sys.stderr, flush=True)
        sys.exit(value.exit_code)

    hook.ends_stops = True
    sys.excepthook = hook


class StopRequest:
    """SIGINT / SIGTERM during training: note it, finish the current step, save, stop. A second one stops
    at once (the previous handler, e.g. KeyboardInterrupt, takes over), unless it comes within
    `REPEAT_WINDOW_S` of the first: that is the same stop delivered twice (torchrun sends its workers SIGTERM
    twice in a row, and a terminal's Ctrl-C reaches every rank besides torchrun's SIGTERM), and acting on it
    would kill the ranks before they save. Nothing is printed inside the handler: writing to a stream the main
    thread is writing to would raise a reentrant-call error."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_WINDOW_S = 2.0

    def __init__(self):
        self.signum: int | None = None
        self.noted_at = 0.0
        self.previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in self.SIGNALS:
            self.previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum, self.noted_at = signum, time.monotonic()
            return
        if time.monotonic() - self.noted_at < self.REPEAT_WINDOW_S:
            return
        previous = self.previous.get(signum, signal.SIG_DFL)
        self.uninstall()
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
