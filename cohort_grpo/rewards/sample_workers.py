"""Scoring a per-sample reward function (one that carries a `score_sample` attribute, as `accuracy_reward` does) in
worker *processes*, one sample per request, for `RewardRunner` (runner.py).

A sample that exceeds the time limit gets None and its process is killed and replaced, so a pathological
expression (math-verify on `9^{9^{9^9}}`) costs one sample, not the batch, and leaves no runaway computation
behind. The workers are plain `python -c` subprocesses talking JSON lines, so they re-import neither torch nor the
user's `__main__` script; the function is imported there by name (`importable_elsewhere`). If the workers cannot be
used at all, the pool scores in this process instead, with a notice, for the rest of the run.
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.completions import completion_text
from cohort_grpo.rewards.user_calls import exception_line

def importable_elsewhere(score_sample) -> bool:
    """A per-sample function a worker process can import by name (not one defined in `__main__`)."""
    module = getattr(score_sample, "__module__", None)
    qualname = getattr(score_sample, "__qualname__", "")
    return callable(score_sample) and module not in (None, "__main__") and "<" not in qualname


WORKER_STARTUP_S = 120.0  # starting python and importing the scoring code; never charged to a sample
WORKER_COMMAND = ("import os, sys; replies = os.fdopen(os.dup(1), 'w'); os.dup2(2, 1); "
                  "from cohort_grpo.rewards.rules import serve_sample_scoring; "
                  "serve_sample_scoring(sys.stdin, replies)")


class WorkerProcess:
    """One scoring subprocess; a reader thread forwards its reply lines into the pool's queue.

    `job` is what it is doing: None (idle), ("load", fn) or ("sample", i); `deadline` bounds the job,
    or the start-up while not `ready`."""

    def __init__(self, replies: queue.Queue):
        env = dict(os.environ)
        # The child imports what the parent can: cohort itself and the module of a user's score_sample.
        package_root = str(Path(__file__).resolve().parents[2])
        paths = [package_root] + [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["OMP_NUM_THREADS"] = "1"
        self.process = subprocess.Popen([sys.executable, "-c", WORKER_COMMAND], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        self.ready = False
        self.loaded: set[str] = set()
        self.job: tuple[str, object] | None = None
        self.deadline = time.monotonic() + WORKER_STARTUP_S
        threading.Thread(target=self._forward, args=(self.process.stdout, replies), daemon=True).start()

    def _forward(self, stream, replies: queue.Queue) -> None:
        try:
            for line in stream:
                replies.put((self, line))
        except (OSError, ValueError):  # the stream was closed under us by kill()
            pass
        replies.put((self, None))  # EOF: the process ended

    def send(self, job: tuple[str, object], request: dict, timeout_s: float) -> None:
        self.job, self.deadline = job, time.monotonic() + timeout_s
        self.process.stdin.write(json.dumps(request, default=str) + "\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.process.stdin, self.process.stdout):
            if stream is self.process.stdout and sys.is_finalizing():
                # At interpreter exit the reader thread may hold this stream's lock while blocked in a
                # read; closing it then aborts Python. The killed process gives that read EOF anyway.
                continue
            try:
                stream.close()
            except (OSError, ValueError):
                pass


class _GiveUp(Exception):
    """The workers cannot do the job (cannot start, cannot import the function)."""


class SampleWorkerPool:
    """Scores a per-sample function over a batch in a few subprocesses, one sample per request, killing
    and replacing a worker whose sample exceeds the time limit. If the workers cannot be used at all,
    it scores in this process instead (with a warning) for the rest of the run."""

    def __init__(self, size: int, timeout_s: float, warn: Callable, raised: Callable):
        self.size, self.timeout_s, self.warn = size, timeout_s, warn
        self.raised = raised  # (name, "Type: message", completions, sample): warns and counts, or raises CohortError
        self.replies: queue.Queue = queue.Queue()
        self.workers: list[WorkerProcess] = []
        self.available = True

    def score(self, name: str, score_sample: Callable, completions: list, columns: dict) -> list:
        fn = f"{score_sample.__module__}:{score_sample.__qualname__}"
        params = list(inspect.signature(score_sample).parameters)[1:]  # the first one takes the completion
        requests = [{"fn": fn, "args": [completion_text(c)],
                     "kwargs": {p: columns[p][i] for p in params if p in columns}}
                    for i, c in enumerate(completions)]
        values: list = [None] * len(completions)
        pending = list(range(len(completions)))[::-1]  # a stack: pop() gives samples in order
        try:
            while len(self.workers) < self.size:
                self.workers.append(WorkerProcess(self.replies))
            self._run(name, fn, requests, values, pending, completions)
        except CohortError:  # reward_errors=raise: the run stops; no worker is left busy with this batch
            self.close()
            raise
        except (_GiveUp, OSError) as e:
            left = sorted(set(pending) | {w.job[1] for w in self.workers if w.job and w.job[0] == "sample"})
            self.available = False
            self.close()
            self.warn(name, "workers", f"reward worker processes failed ({e}); scoring {name!r} in this "
                      "process without a per-sample time limit from now on")
            for i in left:
                try:
                    values[i] = score_sample(requests[i]["args"][0], **requests[i]["kwargs"])
                except Exception as error:  # noqa: BLE001 — user code: as in the workers
                    values[i] = None
                    self.raised(name, exception_line(error), completions, i)
        return values

    def _run(self, name, fn, requests, values, pending, completions) -> None:
        while pending or any(w.job for w in self.workers):
            for w in self.workers:  # hand work to idle, ready workers; load the function first
                if w.ready and w.job is None:
                    if fn not in w.loaded:
                        w.send(("load", fn), {"load": fn}, WORKER_STARTUP_S)
                    elif pending:
                        i = pending.pop()
                        w.send(("sample", i), requests[i], self.timeout_s)
            waiting = [w.deadline for w in self.workers if w.job or not w.ready]
            try:
                worker, line = self.replies.get(timeout=max(0.0, min(waiting, default=60.0) - time.monotonic()))
            except queue.Empty:
                self._expire(name, fn, values, completions)
                continue
            if worker not in self.workers:  # a late line from a worker already replaced
                continue
            if line is None:  # the process ended
                if not worker.ready or (worker.job and worker.job[0] == "load"):
                    raise _GiveUp(f"a worker exited while starting or importing {fn}")
                self._replace(worker, name, values, completions, "died", "lost its worker process")
                continue
            reply = json.loads(line)
            job, worker.job = worker.job, None
            if reply.get("ready"):
                worker.ready = True
            elif job and job[0] == "load":
                if "error" in reply:
                    raise _GiveUp(f"cannot import {fn} in a worker: {reply['error']}")
                worker.loaded.add(fn)
            elif job and job[0] == "sample":
                i = job[1]
                if "error" in reply:
                    self.raised(name, exception_line(reply["error"]), completions, i)
                else:
                    values[i] = reply["value"]

    def _expire(self, name, fn, values, completions) -> None:
        now = time.monotonic()
        for w in list(self.workers):
            if now < w.deadline:
                continue
            if not w.ready or (w.job and w.job[0] == "load"):
                raise _GiveUp(f"a worker did not start or import {fn} within {WORKER_STARTUP_S:g}s")
            if w.job and w.job[0] == "sample":
                self._replace(w, name, values, completions, "timeout",
                              f"took longer than {self.timeout_s:g}s on one sample")

    def _replace(self, worker: WorkerProcess, name, values, completions, kind: str, what: str) -> None:
        i = worker.job[1] if worker.job and worker.job[0] == "sample" else None
        worker.kill()
        self.workers[self.workers.index(worker)] = WorkerProcess(self.replies)
        if i is not None:
            values[i] = None
            self.warn(name, kind, f"reward {name!r} {what} (sample {i}); that sample gets None for it",
                      completions[i])

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []
