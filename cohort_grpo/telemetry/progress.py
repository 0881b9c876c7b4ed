"""The training progress display: a line per logged step, and live bars per phase on a terminal.

On an interactive terminal a `rich` live display shows an overall step bar (with ETA) and one bar per
phase of a GRPO step (sampling, rewards, update, eval) with its rate; the summary line of each step the
run logs (every `logging_steps`, the first and the last) is printed above the bars. Everywhere else --
`quiet=True`, stdout piped to a file or a pager, or a CI environment (`CI` set) -- only the summary lines
are written, each ending with the time left, as plain text without ANSI codes, so logs stay greppable.
A closed pipe (`cohort-grpo train | head`) silences the display instead of killing training.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import IO, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as RichProgress
from rich.text import Text

PHASES = ("sampling", "rewards", "logprobs", "update", "eval")


def _running_in_ci() -> bool:
    """CI services set `CI` (GitHub Actions, GitLab, CircleCI, Travis, ...)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


class _RateColumn(ProgressColumn):
    """Items per second of a bar, in that bar's unit (`12.5 seq/s`): the rate `show_rates` gave for
    the phase's last run, else rich's running estimate from the bar's advances."""

    def render(self, task: Task) -> Text:
        measured = task.fields.get("last_rate"), task.fields.get("last_unit", "it")
        speed, unit = task.finished_speed or task.speed, task.fields.get("unit", "it")
        if measured[0] is not None and (task.finished or speed is None):
            speed, unit = measured
        return Text("" if speed is None else f"{speed:,.1f} {unit}/s", style="progress.data.speed")


class _EtaColumn(ProgressColumn):
    """Time left: rich's estimate where the bar advances (the step bar); for a phase that runs as one
    opaque call (sampling a whole batch) the previous run's duration minus the time spent so far."""

    def render(self, task: Task) -> Text:
        if task.finished:
            return Text("0:00:00", style="progress.remaining")
        remaining = task.time_remaining
        expected = task.fields.get("expected")
        if remaining is None and expected is not None and task.elapsed is not None:
            remaining = max(0.0, expected - task.elapsed)
        if remaining is None:
            return Text("-:--:--", style="progress.remaining")
        return Text(clock(remaining), style="progress.remaining")


def clock(seconds: float) -> str:
    """`H:MM:SS`, rounded to the second."""
    minutes, seconds = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


class Progress:
    """Progress of a training run of `total_steps` GRPO steps. Use as a context manager.

    >>> with Progress(total_steps=10) as progress:
    ...     with progress.phase("sampling", total=64, unit="seq"):
    ...         progress.advance("sampling", 64)
    ...     progress.step_done(1, "Step 1/10: Loss=0.0123, Success=62.50%")

    `durations[name]` holds the wall time in seconds of the last run of each phase.
    """

    def __init__(self, total_steps: int, quiet: bool = False, file: IO[str] | None = None):
        self.total_steps = int(total_steps)
        self.durations: dict[str, float] = {}
        self._rates: dict[str, tuple[float, str]] = {}  # phase → (last measured rate, its unit)
        self._file = file if file is not None else sys.stdout
        self._silenced = False
        console = Console(file=self._file, highlight=False)
        self.live = not quiet and console.is_terminal and not _running_in_ci()
        self._bars: RichProgress | None = None
        self._bar_ids: dict[str, TaskID] = {}
        self._started = False
        self._first_done: tuple[int, float] | None = None  # (step, time) of the first step this display saw
        if self.live:
            self._bars = RichProgress(
                TextColumn("{task.description:>9}"),
                BarColumn(),
                MofNCompleteColumn(),
                _RateColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                _EtaColumn(),
                console=console,
            )
            self._bar_ids["steps"] = self._bars.add_task("steps", total=self.total_steps, unit="step")

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "Progress":
        self.start()
        return self

    def start(self) -> None:
        """Start drawing the bars (idempotent; the first phase or line starts them too, so a caller
        that never enters the context manager, like the trainer, still gets them)."""
        if self._bars is not None and not self._started:
            self._started = True
            self._bars.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self._bars is not None:
            try:
                self._bars.stop()
            except OSError:
                pass
            self._bars = None

    # -- phases ------------------------------------------------------------------------------------
    def _bar(self, name: str) -> TaskID:
        if name not in self._bar_ids:
            self._bar_ids[name] = self._bars.add_task(name, total=None, visible=False)
        return self._bar_ids[name]

    @contextmanager
    def phase(self, name: str, total: int | None = None, unit: str = "it") -> Iterator[None]:
        """Show `name`'s bar (restarted, `total` items, or a pulse when unknown) while the block runs;
        on exit the bar shows as complete and `durations[name]` gets the block's wall time."""
        started = time.perf_counter()
        self.start()
        if self._bars is not None:
            bar_id = self._bar(name)
            last_rate, last_unit = self._rates.get(name, (None, unit))
            self._bars.reset(bar_id, total=total, completed=0, visible=True, unit=unit,
                             expected=self.durations.get(name), last_rate=last_rate, last_unit=last_unit)
            if total is None:  # rich's reset keeps the old total; None makes the bar pulse
                self._task(bar_id).total = None
        try:
            yield
        finally:
            self.durations[name] = time.perf_counter() - started
            if self._bars is not None:
                task = self._task(self._bar_ids[name])
                done = task.total if task.total is not None else max(task.completed, 1)
                self._bars.update(self._bar_ids[name], total=done, completed=done)

    def _task(self, bar_id: TaskID) -> Task:
        return next(task for task in self._bars.tasks if task.id == bar_id)

    def show_rates(self, seconds: dict[str, float], counts: dict[str, tuple[float, str]]) -> dict[str, float]:
        """Set each phase bar's rate to `count / seconds[phase]` in `unit` (`counts[phase] = (count, unit)`),
        shown until that phase runs again with new figures; returns the rates."""
        rates = {name: count / seconds[name] for name, (count, _) in counts.items() if seconds.get(name)}
        for name, rate in rates.items():
            self._rates[name] = (rate, counts[name][1])
            if self._bars is not None:
                self._bars.update(self._bar(name), last_rate=rate, last_unit=counts[name][1])
        return rates

    def advance(self, name: str, n: float = 1) -> None:
        """Move phase `name`'s bar forward by `n` items (sequences sampled, rewards scored, ...)."""
        if self._bars is not None:
            self._bars.advance(self._bar(name), n)

    # -- lines -------------------------------------------------------------------------------------
    def step_done(self, step: int, line: str, shown: bool = True) -> None:
        """Move the step bar to `step`, and print the step's summary line (above the bars) when `shown` (a
        logged step) or when it is the first step this display sees (the run is under way). Without bars the
        line ends with the time left, at the pace of the steps since that first one (which warms up)."""
        now = time.perf_counter()
        first = self._first_done is None
        if first:
            self._first_done = (step, now)
        if shown or first:
            self.print(line if self._bars is not None else line + self._time_left(step, now))
        if self._bars is not None:
            self._bars.update(self._bar_ids["steps"], completed=step)

    def _time_left(self, step: int, now: float) -> str:
        first_step, first_time = self._first_done
        if step <= first_step or step >= self.total_steps:
            return ""
        per_step = (now - first_time) / (step - first_step)
        return f", eta {clock(per_step * (self.total_steps - step))}"

    def print(self, line: str) -> None:
        """Print one line of text as it is (no markup), above the bars when they are shown."""
        if self._silenced:
            return
        self.start()
        try:
            if self._bars is not None:
                self._bars.console.print(line, markup=False, highlight=False, soft_wrap=True)
            else:
                self._file.write(f"{line}\n")
                self._file.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._silence()

    def _silence(self) -> None:
        """The reader went away: stop writing, and point stdout at /dev/null so the interpreter's
        final flush does not raise BrokenPipeError either."""
        self._silenced = True
        self.close()
        if self._file is sys.stdout:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
            except (OSError, ValueError, AttributeError):
                pass
