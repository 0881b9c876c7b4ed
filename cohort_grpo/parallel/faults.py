"""A rank that dies or hangs in a job of several ranks: every wait on another rank ends within --ddp_timeout,
and the job ends with one line that names the rank that failed first and what failed.

- `waiting_for(what)` names the wait a rank is in (a rollout from its sampling rank, the weight broadcast of
  policy version 3); a collective that fails inside it becomes a one-line `CohortError` saying what this rank
  was waiting for and for how long. `lost_rank_error` does the same for a collective outside any named wait
  (DDP's gradient all-reduce).
- `wait_all(works, what, timeout_s, poll)`: waits on asynchronous collectives with a deadline. On NCCL, wait()
  returns at once on the CPU (only the GPU waits) and NCCL's own watchdog ends a hung rank with an abort and
  a page of log; polling the work's completion instead ends the wait in Python, in one line. A gloo work
  completes only inside wait(), which the group's timeout bounds.
- The launcher's side (`cohort-grpo train --nproc_per_node N`): torchrun runs inside `python -m cohort_grpo.parallel.faults
  FILE ...`, which writes the failures torchrun saw (rank, exit code, signal) to FILE instead of its report;
  each rank writes the one line of its own error beside it (`record_rank_error`); `job_failure_line` picks
  the root cause among them.

For fault tests only (tests/test_faults.py, bench/faults.py): COHORT_INJECT_FAULT=withhold_weights:V makes rank 0
skip the weight broadcasts of policy version V and later, so the sampling ranks wait for weights that never
come, as with a broadcast that hangs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

from cohort_grpo.errors import CohortError
from cohort_grpo.parallel.placement import Placement

INJECT_ENV = "COHORT_INJECT_FAULT"
REPORT_ENV = "COHORT_FAULT_REPORTS"  # the folder where the ranks a launcher started write their error line
# Signals that end a rank because another one failed: torchrun stops the survivors with them.
STOPPING_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
COLLECTIVE_MARKERS = ("gloo", "NCCL", "Connection reset", "Connection closed", "timed out", "Timed out", "timeout",
                      "pair closure")


def withheld_weights(version: int) -> bool:
    """The injected fault says rank 0 must not broadcast the weights of policy `version` (fault tests only)."""
    name, _, start = os.environ.get(INJECT_ENV, "").partition(":")
    return name == "withhold_weights" and start.isdigit() and version >= int(start)


def this_rank() -> str:
    return os.environ.get("RANK", "?")


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def failed_collective(error: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(error, getattr(dist, "DistError", ())) or any(m in str(error) for m in COLLECTIVE_MARKERS)


@contextlib.contextmanager
def waiting_for(what: str) -> Iterator[None]:
    """Around a wait on other ranks: a collective that fails inside it ends this rank with one line naming
    `what` (e.g. "a message from sampling rank 2") and how long it waited. Only waits go inside: any
    RuntimeError there is the collective's."""
    started = time.monotonic()
    try:
        yield
    except RuntimeError as error:
        raise CohortError(f"rank {this_rank()} stopped waiting for {what} after {time.monotonic() - started:.1f} s "
                          f"({first_line(error)}): that rank died or hung (--ddp_timeout bounds the wait)") from error


class CollectiveTimeout(RuntimeError):
    """A wait of `wait_all` ran past its deadline (a RuntimeError, as torch's own timeouts are)."""


def wait_all(works: Sequence, what: str, timeout_s: float, poll: bool) -> None:
    """Wait for every one of `works` (asynchronous collectives) for at most `timeout_s` seconds in all; poll:
    their backend completes them without wait() (NCCL), so their completion is polled against the deadline."""
    with waiting_for(what):
        deadline = time.monotonic() + timeout_s
        for work in works:
            if poll:
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise CollectiveTimeout(f"Timed out: not complete within --ddp_timeout {timeout_s:g} s")
                    time.sleep(0.002)
            work.wait()


# The line of a rank that stopped because another one failed alike (cohort_grpo/run/failure.py): that rank's line is the cause.
RELAYED = "stopped with rank"
# The line of a collective that failed outside a named wait: a symptom of another rank's fault, whose own
# line (a named wait, a kill) is the root cause when there is one, even if it was written a moment later.
LOST_COLLECTIVE = "a collective with the other ranks failed"
# A named wait that ended because the other side closed the connection: that side gave up first (its own wait
# ran to its deadline, or it crashed), so its line is the cause, whichever was written first.
PEER_CLOSED = ("pair closure", "Connection closed", "Connection reset", "closed by peer")


def lost_rank_error(error: RuntimeError) -> Exception:
    """A one-line CohortError for a collective that failed outside a named wait; any other error unchanged."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not failed_collective(error):
        return error
    return CohortError(f"rank {this_rank()} stopped: {LOST_COLLECTIVE} ({first_line(error)}); "
                       "another rank died or hung (--ddp_timeout bounds the wait)")


# ---- the launcher's side ------------------------------------------------------------------------------------
def record_rank_error(line: str) -> bool:
    """Under `cohort-grpo train --nproc_per_node`: leave this rank's error line for the launcher, which prints the
    one of the rank that failed first. False when no launcher of ours collects it (print it yourself)."""
    folder = os.environ.get(REPORT_ENV)
    if not folder or "RANK" not in os.environ:
        return False
    record = {"time": time.time(), "line": line}
    try:
        (Path(folder) / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(record))
    except OSError:
        return False
    return True


def job_failure_line(folder: Path, placement: Placement) -> str | None:
    """The one line that ends a failed job of `placement`: the rank that failed first, its part (trainer or
    sampling rank) and what failed. Root cause: a rank killed by a signal torchrun does not send (kill -9, a
    crash), else the earliest error line a rank left (one whose own wait ended before one whose peer closed the
    connection, and either before a collective that merely failed), else torchrun's first failure. None when nothing was recorded."""
    try:
        failures = json.loads((folder / "torchrun.json").read_text())
    except (OSError, ValueError):
        failures = {}
    reports = {}
    for path in folder.glob("rank-*.json"):
        try:
            reports[int(path.stem.split("-")[1])] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    killed = sorted((info["time"], int(rank)) for rank, info in failures.items()
                    if info.get("signal") and info["signal"] not in STOPPING_SIGNALS and int(rank) not in reports)
    if killed:
        rank = killed[0][1]
        what = f"was killed by {failures[str(rank)]['signal']}"
        if failures[str(rank)]["signal"] == "SIGABRT":
            what += " (an abort: on GPUs, NCCL's watchdog aborts a rank whose collective ran past --ddp_timeout)"
    elif reports:
        rank = min(reports, key=lambda r: (reports[r]["line"].startswith(RELAYED), LOST_COLLECTIVE in reports[r]["line"],
                                           any(m in reports[r]["line"] for m in PEER_CLOSED), reports[r]["time"]))
        what = reports[rank]["line"]
        if what.startswith(f"rank {rank} "):
            what = what[len(f"rank {rank} "):]
    elif failures:
        rank = min((int(r) for r in failures), key=lambda r: failures[str(r)]["time"])
        info = failures[str(rank)]
        what = f"exited with code {info['exitcode']}" + (f" ({info['signal']})" if info.get("signal") else "")
    else:
        return None
    part = "sampling rank" if placement.samples_here(rank) else "trainer"
    return f"rank {rank} ({part}) {what}"


def run_torchrun(argv: list[str]) -> int:
    """`python -m cohort_grpo.parallel.faults FILE <torchrun options> -m cohort_grpo train ...`: torchrun, with the failures of
    the ranks it started written to FILE as JSON instead of torchrun's report."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    report = Path(argv[0])
    try:
        run(parse_args(argv[1:]))
    except ChildFailedError as error:
        report.write_text(json.dumps({str(rank): {"exitcode": failure.exitcode, "time": failure.timestamp,
                                                  "signal": failure.signal_name() if failure.exitcode < 0 else None}
                                      for rank, failure in error.failures.items()}))
        return 1
    except SignalException as stop:  # the launcher forwarded a signal; the ranks' own lines say what they saved
        return 128 + int(getattr(stop, "sigval", signal.SIGTERM))
    return 0


if __name__ == "__main__":
    sys.exit(run_torchrun(sys.argv[1:]))
