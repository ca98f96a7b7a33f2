"""Deep mode: consecutive seeds until a last seed or a time budget, stopping at the first
failure (`sweep`; `sweep_with_progress` with a progress bar)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import attrs

from atom_core.simulate.driver import run
from atom_core.simulate.report import Report


@attrs.frozen
class SweepResult:
    """What a sweep ran; `failing`: the first failing seed's report (shrunk), if any."""

    seeds_run: int
    first_seed: int
    ticks: int
    seconds: float
    failing: Report | None

    @property
    def ok(self) -> bool:
        return self.failing is None

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "seeds_run": self.seeds_run, "first_seed": self.first_seed,
                "last_seed": self.first_seed + self.seeds_run - 1, "ticks": self.ticks,
                "seconds": round(self.seconds, 1),
                "steps_per_second": round(self.ticks / self.seconds, 1) if self.seconds else 0,
                "failing_seed": None if self.failing is None else self.failing.seed,
                "replay": None if self.failing is None else self.failing.replay_command(),
                "report": None if self.failing is None else self.failing.as_json()}


def sweep(first_seed: int, steps: int, *, last_seed: int | None = None,
          seconds: float | None = None, faults: frozenset[str] | None = None,
          on_seed: Callable[[Report, float], None] | None = None,
          **fixed: Any) -> SweepResult:
    """Consecutive seeds from `first_seed` until `last_seed` (inclusive) or until `seconds` of
    wall time are used, stopping at the first failing seed (shrunk). The wall clock decides
    only how many seeds run, never what a seed does. `on_seed(report, elapsed)` after each."""
    t0 = time.monotonic()
    seed, ticks, n = first_seed, 0, 0
    while (last_seed is None or seed <= last_seed) and (
            seconds is None or time.monotonic() - t0 < seconds):
        rep = run(seed, steps, faults, shrink=False, **fixed)
        n += 1
        ticks += rep.ticks
        if on_seed is not None:
            on_seed(rep, time.monotonic() - t0)
        if not rep.ok:
            rep = run(seed, steps, faults, shrink=True, **fixed)
            return SweepResult(n, first_seed, ticks, time.monotonic() - t0, rep)
        seed += 1
    return SweepResult(n, first_seed, ticks, time.monotonic() - t0, None)


def sweep_with_progress(first_seed: int, steps: int, *, last_seed: int | None = None,
                        seconds: float | None = None, faults: frozenset[str] | None = None,
                        show: bool = True, **fixed: Any) -> SweepResult:
    """`sweep` with a progress bar on stderr (rich; plain lines without it)."""
    total = (last_seed - first_seed + 1) if last_seed is not None else seconds
    failures = 0
    bar: Any = None
    if show:
        try:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            pass
        else:
            bar = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                           console=Console(stderr=True))
    task = None

    def on_seed(rep: Report, elapsed: float) -> None:
        nonlocal failures
        failures += not rep.ok
        what = (f"seed {rep.seed}: {'ok' if rep.ok else 'FAILED'} "
                f"({rep.steps_per_second} ticks/s, {rep.faults_injected} faults)")
        if bar is not None:
            done = rep.seed - first_seed + 1 if last_seed is not None else elapsed
            bar.update(task, completed=done, description=what)
        elif show:
            print(what, file=sys.stderr, flush=True)

    if bar is None:
        return sweep(first_seed, steps, last_seed=last_seed, seconds=seconds, faults=faults,
                     on_seed=on_seed, **fixed)
    with bar:
        task = bar.add_task(f"seeds from {first_seed}", total=total)
        return sweep(first_seed, steps, last_seed=last_seed, seconds=seconds, faults=faults,
                     on_seed=on_seed, **fixed)
