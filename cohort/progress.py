"""The training progress display: one line per step, and live bars per phase on a terminal.

On an interactive terminal a `rich` live display shows an overall step bar (with ETA) and one bar per
phase of a GRPO step (sampling, rewards, update, eval) with its rate; each finished step's summary line
is printed above the bars. Everywhere else -- `quiet=True`, stdout piped to a file or a pager, or a CI
environment (`CI` set) -- only the summary lines are written, as plain text without ANSI codes, so logs
stay greppable. A closed pipe (`cohort train | head`) silences the display instead of killing training.
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
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.text import Text

PHASES = ("sampling", "rewards", "update", "eval")


def _running_in_ci() -> bool:
    """CI services set `CI` (GitHub Actions, GitLab, CircleCI, Travis, ...)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


class _RateColumn(ProgressColumn):
    """Items per second of a bar, in that bar's unit (`12.5 seq/s`)."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        unit = task.fields.get("unit", "it")
        return Text("" if speed is None else f"{speed:,.1f} {unit}/s", style="progress.data.speed")


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
        self._file = file if file is not None else sys.stdout
        self._silenced = False
        console = Console(file=self._file, highlight=False)
        self.live = not quiet and console.is_terminal and not _running_in_ci()
        self._bars: RichProgress | None = None
        self._bar_ids: dict[str, TaskID] = {}
        if self.live:
            self._bars = RichProgress(
                TextColumn("{task.description:>9}"),
                BarColumn(),
                MofNCompleteColumn(),
                _RateColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=console,
            )
            self._bar_ids["steps"] = self._bars.add_task("steps", total=self.total_steps, unit="step")

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "Progress":
        if self._bars is not None:
            self._bars.start()
        return self

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
        if self._bars is not None:
            bar_id = self._bar(name)
            self._bars.reset(bar_id, total=total, completed=0, visible=True, unit=unit)
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

    def advance(self, name: str, n: float = 1) -> None:
        """Move phase `name`'s bar forward by `n` items (sequences sampled, rewards scored, ...)."""
        if self._bars is not None:
            self._bars.advance(self._bar(name), n)

    # -- lines -------------------------------------------------------------------------------------
    def step_done(self, step: int, line: str) -> None:
        """Print a finished step's summary line (above the bars) and move the step bar to `step`."""
        self.print(line)
        if self._bars is not None:
            self._bars.update(self._bar_ids["steps"], completed=step)

    def print(self, line: str) -> None:
        """Print one line of text as it is (no markup), above the bars when they are shown."""
        if self._silenced:
            return
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
