"""Progress a person can see: a ``rich`` bar on a terminal, a log line at a steady pace otherwise.

With output to a file or a pipe (CI, ``nohup``, a worker's log) a bar shows nothing until the
work ends; :class:`SteadyLog` writes ``samples 96/500 (19 %), 12.0/s, about 34 s left`` every
``interval`` seconds instead. Neither shows anything before the first real progress, so a job
that fails while loading leaves no empty ``0/?`` bar behind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

log = logging.getLogger("headcat")

DEFAULT_INTERVAL = 15.0  # seconds between two progress lines when there is no terminal


class SteadyLog:
    """``progress(done, total)`` as a log line at most every ``interval`` seconds, and at the end."""

    def __init__(
        self,
        description: str,
        interval: float = DEFAULT_INTERVAL,
        *,
        logger: logging.Logger = log,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.description, self.interval, self.logger, self.clock = description, interval, logger, clock
        self._started: float | None = None
        self._first = 0  # work done at the first report (the rate counts what came after it)
        self._last: float | None = None
        self._finished = False

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if self._started is None:
            self._started = self._last = now  # the first report starts the clock; nothing is written yet
            self._first = done
        finished = total > 0 and done >= total
        if self._finished or (not finished and now - (self._last or now) < self.interval):
            return
        self._last, self._finished = now, finished
        self.logger.info("%s", self.line(done, total, done - self._first, now - self._started))

    def line(self, done: int, total: int, since: int, elapsed: float) -> str:
        """``samples 96/500 (19 %), 12.0/s, about 34 s left``: ``since`` done in the last ``elapsed`` s."""
        share = f" ({100 * done / total:.0f} %)" if total > 0 else ""
        text = f"{self.description} {done}/{total}{share}"
        if elapsed > 0 and since > 0:
            rate = since / elapsed
            text += f", {rate:.1f}/s"
            if total > done:
                text += f", about {_duration((total - done) / rate)} left"
        return text


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@contextmanager
def reporter(description: str, console: Console, interval: float = DEFAULT_INTERVAL) -> Iterator[Any]:
    """A ``progress(done, total)`` for work done in this process: a bar when ``console`` is a
    terminal (shown from the first report on), else a :class:`SteadyLog`."""
    if not console.is_terminal:
        yield SteadyLog(description, interval)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    task: Any = None

    def update(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task(description, total=total)
        bar.update(task, completed=done, total=total)

    try:
        yield update
    finally:
        if task is not None:
            bar.stop()
