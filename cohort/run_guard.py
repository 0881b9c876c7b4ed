"""The run around its checkpoints: what the trainer calls so that a run is never lost.

Before any heavy work the output folder is checked (writable, no earlier run overwritten by
accident); at start a checkpoint is loaded when asked (`--resume`); after each step one is saved
when due, and on SIGINT / SIGTERM or too many non-finite updates in a row the run saves and stops
(`StopRequest`, `TrainingInterrupted`); an update whose loss or gradient norm is NaN/inf is
skipped (`update_is_finite`). The checkpoint folder format itself is `checkpoint.py` (writing,
verifying) and `checkpoint_load.py` (reading). docs/reliability.md tells the whole story.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
import torch

from .checkpoint import (_parallel, _remove_leftovers, _step_of, _truncate_logs, check_checkpoint, list_checkpoints,
                         newest_complete, save_checkpoint)
from .errors import CohortError
from .metrics import COMPLETIONS_FILE, METRICS_FILE


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM arrived; a checkpoint was saved. The CLI exits with 128 + the signal number. A
    KeyboardInterrupt, so code that lets Ctrl-C through lets this through too."""

    def __init__(self, signum: int, checkpoint: Path):
        self.signum, self.checkpoint = signum, checkpoint
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {_step_of(checkpoint)}; checkpoint "
                         f"saved in {checkpoint} — continue the run with --resume")


def prepare_output_dir(args, log=print) -> None:
    """Before any heavy work: output_dir is writable, and a run there is not overwritten by accident."""
    out = Path(args.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise CohortError(f"output_dir {str(out)!r} is not writable ({error.strerror or error}); choose a folder "
                          "you can write to (--output_dir)") from None
    first_rank = int(os.environ.get("RANK", "0")) == 0  # several processes: rank 0 alone cleans and deletes
    if first_rank:
        _remove_leftovers(out)
    if args.resume_from_checkpoint not in (None, "latest"):
        reason = check_checkpoint(Path(args.resume_from_checkpoint))
        if reason:
            raise CohortError(f"cannot resume from {args.resume_from_checkpoint}: it is {reason}; pass a complete "
                              "checkpoint-<step> folder or --resume to pick the newest complete one")
    existing = list_checkpoints(out)
    if existing and not (args.resume or args.resume_from_checkpoint):
        if not args.overwrite_output_dir:
            raise CohortError(f"output_dir {str(out)!r} already holds checkpoints of an earlier run (newest: "
                              f"{existing[-1].name}); pass --resume to continue it, --overwrite_output_dir to "
                              "start over, or choose another --output_dir")
        if not first_rank:
            return
        log(f"overwrite_output_dir: removing {len(existing)} checkpoint(s) and the metrics of the earlier run in {out}")
        for folder in existing:
            shutil.rmtree(folder)
        _truncate_logs(out, {METRICS_FILE: 0, COMPLETIONS_FILE: 0}, log)


def resume(trainer) -> None:
    """Install the SIGINT/SIGTERM handlers; with --resume / resume_from_checkpoint, load a checkpoint."""
    trainer.stop_request = StopRequest()
    trainer.stop_request.install()
    args = trainer.args
    spec = args.resume_from_checkpoint or ("latest" if args.resume else None)
    if spec is None:
        return
    out = Path(args.output_dir)
    parallel = _parallel(trainer)
    folder = newest_complete(out, trainer.log) if spec == "latest" and parallel.is_main else Path(spec)
    folder = parallel.broadcast_object(folder)  # rank 0 checked the hashes; every rank loads the same folder
    if folder is None:
        trainer.log(f"no complete checkpoint in {out}: starting the run from step 0")
        if parallel.is_main:
            _truncate_logs(out, {METRICS_FILE: 0, COMPLETIONS_FILE: 0}, trainer.log)  # lines of no checkpoint
        return
    from .checkpoint_load import load_checkpoint  # the reading half of the format (it imports this module)

    load_checkpoint(trainer, folder)
    trainer.log(f"resumed from {folder} at step {trainer.step}")


def maybe_save(trainer) -> None:
    """End of a step: save every save_steps and at the last step; stop on a signal or on too many
    non-finite updates in a row (after saving, so nothing is lost)."""
    args, step = trainer.args, trainer.step
    stop = getattr(trainer, "stop_request", None)
    parallel = _parallel(trainer)
    if stop is not None and parallel.world_size > 1:  # all ranks stop at the same step, or none does
        stop.signum = next((s for s in parallel.gather_objects(stop.signum) if s is not None), None)
    too_many_faults = trainer.nonfinite_in_a_row >= args.max_consecutive_nonfinite
    due = (args.save_steps and step % args.save_steps == 0) or step == args.max_steps
    if due or too_many_faults or (stop is not None and stop.signum is not None):
        folder = save_checkpoint(trainer)
    if too_many_faults:
        finish(trainer, early=True)
        raise CohortError(f"{trainer.nonfinite_in_a_row} updates in a row had a non-finite loss or gradient (up to "
                          f"step {step}); stopped with the last finite weights in {folder}: lower --learning_rate, "
                          "lower --max_grad_norm, or check the reward functions for inf/NaN")
    if stop is not None and stop.signum is not None:
        finish(trainer, early=True)
        raise TrainingInterrupted(stop.signum, folder)


def update_is_finite(trainer, loss: float, grad_norm) -> bool:
    """False (and the gradients dropped, the skip counted) when the loss or the gradient norm is NaN/inf:
    one bad batch must not poison the weights and the Adam moments for the rest of the run."""
    if np.isfinite(loss) and bool(torch.isfinite(torch.as_tensor(grad_norm)).all()):
        trainer.nonfinite_in_a_row = 0
        return True
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.skipped_steps += 1
    trainer.nonfinite_in_a_row += 1
    trainer.log(f"step {trainer.step}: non-finite loss ({loss}) or gradient norm ({float(grad_norm)}): update "
                f"skipped ({trainer.nonfinite_in_a_row} in a row, {trainer.skipped_steps} in all)")
    return False


def finish(trainer, early: bool = False) -> None:
    """SIGINT/SIGTERM back to their previous handlers; leaving train() early, close the logs and display."""
    if early:
        trainer.metrics.close()
        trainer.progress.close()
    if getattr(trainer, "stop_request", None) is not None:
        trainer.stop_request.uninstall()


class StopRequest:
    """SIGINT / SIGTERM during training: note it, finish the current step, save, stop. A second one stops
    at once (the previous handler, e.g. KeyboardInterrupt, takes over). Nothing is printed inside the
    handler: writing to a stream the main thread is writing to would raise a reentrant-call error."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
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
            self.signum = signum
            return
        previous = self.previous.get(signum, signal.SIG_DFL)
        self.uninstall()
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
