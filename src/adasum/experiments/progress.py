"""What the harness shows while it trains: progress bars on a terminal, plain lines elsewhere."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("adasum")


class ProgressBar:
    """Progress of a run or a sweep on stderr.

    On a terminal (with rich installed): a live bar for the run in progress (a finished run's bar is
    removed) and, in a sweep, one bar for the whole sweep ("run k/n") with its time remaining;
    while the bars are live the ``adasum`` logger prints through rich's handler on the same
    console, above them, instead of splicing into them. Elsewhere (a file, CI) or without rich:
    plain lines, one per run ("run k/n: ..."), among the log lines. Disabled: nothing.

    >>> with ProgressBar(True) as bar:  # doctest: +SKIP
    ...     bar.sweep(9)
    ...     advance = bar.task("adasum P=16 lr=0.05 seed=0", total=100)

    Not on a terminal (here a rich console writing to a string): plain lines, one per run, through the
    ``adasum`` logger (printed here by a handler on stdout):

    >>> import io, sys
    >>> from rich.console import Console
    >>> handler, level = logging.StreamHandler(sys.stdout), log.level
    >>> log.addHandler(handler); log.setLevel(logging.INFO)
    >>> with ProgressBar(True, console=Console(file=io.StringIO(), force_terminal=False)) as bar:
    ...     bar.sweep(2)
    ...     advance = bar.task("sequential P=1 lr=0.05 seed=0", total=100)
    ...     advance(100)
    ...     advance = bar.task("adasum P=16 lr=0.05 seed=0", total=100)
    run 1/2: sequential P=1 lr=0.05 seed=0
    run 2/2: adasum P=16 lr=0.05 seed=0
    >>> bar.live
    False
    >>> log.removeHandler(handler); log.setLevel(level)
    """

    def __init__(self, enabled: bool, console: Any = None) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._handlers: list[logging.Handler] | None = None
        self._runs = 0  # runs in the sweep (0: not a sweep)
        self._started = 0
        self._sweep_task: Any = None
        self._run_task: Any = None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        except ImportError:
            return
        console = console if console is not None else Console(stderr=True)
        if not console.is_terminal:
            return
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )

    @property
    def live(self) -> bool:
        """Whether rich bars are drawn (a terminal), not plain lines."""
        return self._progress is not None

    @property
    def bars(self) -> list[tuple[str, float, float | None]]:
        """The bars drawn now, as (description, completed, total), the sweep's first; none unless `live`."""
        if self._progress is None:
            return []
        return [(t.description, t.completed, t.total) for t in self._progress.tasks]

    def __enter__(self) -> ProgressBar:
        if self._progress is not None:
            from rich.logging import RichHandler

            self._progress.start()
            handler = RichHandler(
                console=self._progress.console, show_time=False, show_path=False, show_level=False, markup=False
            )
            handler.setFormatter(logging.Formatter("%(message)s"))
            self._handlers, log.handlers = log.handlers[:], [handler]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._handlers is not None:
            log.handlers, self._handlers = self._handlers, None

    def sweep(self, runs: int) -> None:
        """Count the next `runs` runs as one sweep (its own bar, "run k/n")."""
        self._runs, self._started = runs, 0
        if self._progress is not None:
            self._sweep_task = self._progress.add_task(f"sweep: {runs} runs", total=runs)

    def skip(self) -> None:
        """A run of the sweep that needs no training (taken from the results file)."""
        self._started += 1
        if self._sweep_task is not None:
            self._progress.update(self._sweep_task, completed=self._started)

    def task(self, description: str, total: int, completed: int = 0) -> Callable[[int], None]:
        """Start the bar of a run of `total` steps; a function that advances it by its argument."""
        self._started += 1
        label = f"run {self._started}/{self._runs}: {description}" if self._runs else description
        if self._progress is None:
            if self.enabled:
                log.info("%s", label)
            return lambda n: None
        progress = self._progress
        if self._run_task is not None:
            progress.remove_task(self._run_task)
        run = self._run_task = progress.add_task(label, total=total, completed=completed)
        sweep = self._sweep_task
        if sweep is None:
            return lambda n: progress.advance(run, n)
        done = self._started - 1
        progress.update(sweep, completed=done + completed / total)

        def advance(n: int) -> None:
            progress.advance(run, n)
            progress.advance(sweep, n / total)

        return advance
