"""The driver: `Sim` plays one run's events against its server and runs the checks after each
tick; `run` draws a seed's events, `replay` plays recorded ones, `shortest_failing_prefix`
shrinks a failure."""

from __future__ import annotations

import random
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs
import torch

from atom_core.config import Config
from atom_core.simulate import model
from atom_core.simulate.checks import LEAK_CHECKS
from atom_core.simulate.checks import cluster as cluster_checks
from atom_core.simulate.checks.at_rest import at_rest
from atom_core.simulate.checks.endings import ending_problems
from atom_core.simulate.checks.invariants import invariant_violations
from atom_core.simulate.dimensions import SimConfig, UsageError, batcher_configs, draw_config
from atom_core.simulate.events import Failure, SimEvent
from atom_core.simulate.faults import FAULTS, applicable
from atom_core.simulate.faulty_runtime import FaultyRuntime
from atom_core.simulate.report import Report, report_of
from atom_core.simulate.servers import Clustered, Colocated, Disaggregated, Server, SimClock
from atom_core.simulate.workload import make_workload

DRAIN_BASE, DRAIN_PER_REQUEST = 400, 40  # the drain's tick cap: base + per unfinished request
SHRINK_WALK = 4  # after bisection, how many shorter prefixes to try (failures need not be
# monotone in the prefix length)


class Sim:
    """One run: builds the server for `cfg`, applies events, checks after each tick."""

    def __init__(self, cfg: SimConfig, faults: frozenset[str], steps: int,
                 wrap_runtime: Callable[[Any, str], Any] | None = None) -> None:
        self.cfg, self.faults, self.steps = cfg, faults, steps
        self.configs = batcher_configs(cfg)
        self.wrap_runtime = wrap_runtime
        torch.manual_seed(cfg.seed)
        self.junk = torch.Generator().manual_seed(cfg.seed)
        self.workload = make_workload(cfg, steps + 8)
        self.clock = SimClock()
        self.injected: Counter[str] = Counter()
        self.events: list[SimEvent] = []
        self.submitted: list[int] = []  # workload indices, in submission order
        self.ids: dict[int, int] = {}  # workload index -> server request id
        self.outcomes: dict[int, list[str]] = {}
        self.failures: list[Failure] = []
        self.tick_no = 0
        self.drain_ticks = 0
        self.oracle: Any = None
        self.server: Server = Clustered(self) if cfg.cluster else \
            Disaggregated(self) if cfg.pd else Colocated(self)

    # ------------------------------------------------------------------ plumbing
    def runtime(self, side: str, conf: Config) -> FaultyRuntime:
        """A runtime for the server `side` (`conf`), by the run's `runtime` name in the
        registry (model.load)."""
        inner, oracle = model.load(self.cfg, conf)
        self.oracle = self.oracle or oracle
        rt = inner if self.wrap_runtime is None else self.wrap_runtime(inner, side)
        return FaultyRuntime(rt, self.junk, self.count)

    def trace_sink(self, side: str) -> IO[str] | None:
        """Where the batcher of `side` writes its transitions (none here; `traced.TracedSim`
        keeps them, to draw the run)."""
        return None

    def count(self, kind: str) -> None:
        self.injected[kind] += 1

    def fail(self, kind: str, detail: str) -> None:
        self.failures.append(Failure(kind, self.tick_no, detail))

    # ------------------------------------------------------------------ events
    def play(self, source: Iterable[SimEvent]) -> None:
        """Apply events until the source ends or something fails, then drain."""
        for ev in source:
            self.events.append(ev)
            self._guarded(lambda ev=ev: self.apply(ev))
            if self.failures:
                return
        self._guarded(self.drain)

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - any escape from the batcher is a finding
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self.fail("crash", f"{type(exc).__name__}: {exc} (in {where.name}, "
                      f"{Path(where.filename).name}:{where.lineno})")

    def apply(self, ev: SimEvent) -> None:
        if ev.kind == "step":
            self.tick()
            return
        if ev.kind == "submit":
            self.submit(ev.arg("request"))
        else:
            FAULTS[ev.kind].apply(self, ev)
        self.check()  # submit and abort are core transitions too

    def submit(self, i: int) -> None:
        sid = self.server.submit(self.workload[i])
        self.submitted.append(i)
        self.ids[i] = sid
        self.outcomes[i] = []
        _, error = self.server.result(sid)
        if error is not None:  # refused at once (PD: prefill worker lost, no local fallback)
            self.ended(i, "error")

    def tick(self) -> None:
        self.tick_no += 1
        self.clock.now += 1.0
        by_id = {sid: i for i, sid in self.ids.items()}
        for sid, kind in self.server.tick():
            self.ended(by_id[sid], kind)
        self.check()
        if isinstance(self.server, Clustered):  # (the frontend just read every report)
            for problem in cluster_checks.router_problems(self.server):
                self.fail("router", problem)

    def ended(self, i: int, kind: str) -> None:
        """Request `i` ended (`kind`: finished, error, abort); `ending_problems` checks it."""
        self.outcomes[i].append(kind)
        for failure_kind, detail in ending_problems(self, i, kind):
            self.fail(failure_kind, detail)
        if isinstance(self.server, Clustered):
            for failure_kind, detail in cluster_checks.ending_problems(self, i, kind):
                self.fail(failure_kind, detail)

    def check(self) -> None:
        for problem in invariant_violations(self.server):
            self.fail("invariant", problem)
        for rule in LEAK_CHECKS:
            for problem in rule(self.server):
                self.fail("leak", problem)

    # ------------------------------------------------------------------ the end
    def drain(self) -> None:
        """Stop injecting, let everything finish (capped), then check every request ended and
        every block is at rest."""
        for rt in self.server.runtimes.values():
            rt.disarm()
        for link in self.server.links.values():
            link.armed.clear()
            if link.held:
                link.inner.release()
                link.held = False
        live = sum(1 for i in self.submitted if not self.outcomes[i])
        cap = DRAIN_BASE + DRAIN_PER_REQUEST * live
        quiet = 0
        while quiet < 2:  # idle twice in a row: nothing arrived in between
            if self.drain_ticks >= cap:
                self.fail("drain", f"not idle after {cap} drain ticks; unfinished requests "
                          f"{[i for i in self.submitted if not self.outcomes[i]]}")
                return
            self.drain_ticks += 1
            self.tick()
            if self.failures:
                return
            quiet = quiet + 1 if self.server.idle() else 0
        for i in self.submitted:
            if not self.outcomes[i]:
                self.fail("lifecycle", f"request {i} never ended")
        for side, b in self.server.at_rest().items():
            for problem in at_rest(side, b):
                self.fail("leak", problem)


def _draw_events(sim: Sim, seed: int) -> Iterator[SimEvent]:
    """The seed's events, drawn lazily: each draw sees the state the previous events left."""
    rng = random.Random(seed)
    kinds = [FAULTS[name] for name in sorted(sim.faults)]
    pending = iter(range(len(sim.workload)))
    for tick in range(sim.steps):
        burst = 3 if rng.random() < 0.05 else 1 if rng.random() < 0.35 else 0
        for _ in range(burst if tick else 2):  # two requests right away
            i = next(pending, None)
            if i is not None:
                yield SimEvent.of("submit", request=i)
        for kind in kinds:
            if rng.random() < kind.rate:
                args = kind.draw(sim, rng)
                if args is not None:
                    yield SimEvent.of(kind.name, **args)
        yield SimEvent("step")


def _simulate(cfg: SimConfig, faults: frozenset[str], steps: int,
              events: Iterable[SimEvent] | None,
              wrap_runtime: Callable[[Any, str], Any] | None) -> Sim:
    sim = Sim(cfg, faults, steps, wrap_runtime)
    sim.play(_draw_events(sim, cfg.seed) if events is None else events)
    return sim


def run(seed: int, steps: int, faults: frozenset[str] | None = None, *, shrink: bool = False,
        wrap_runtime: Callable[[Any, str], Any] | None = None, **fixed: Any) -> Report:
    """Simulate `seed` for `steps` ticks, then drain; never prints.

    `faults`: the kinds to inject (None: every kind that applies to the configuration; see
    `FAULTS`). `fixed`: configuration dimensions to fix (see `DIMENSIONS`), e.g. `mode="pd"`.
    `shrink`: on failure, also find the shortest failing prefix of the event list
    (`Report.failing_prefix`; it replays the run a few dozen times at most).
    `wrap_runtime(runtime, side)`: wraps each reference runtime (tests plant bugs with it);
    the oracle always uses the unwrapped model. `str(report)` is a one-line summary.
    Raises `UsageError` for unknown fault kinds or dimensions, or impossible fixed values."""
    if steps < 0:
        raise UsageError(f"steps must be >= 0, got {steps}")
    if faults is not None and set(faults) - set(FAULTS):
        raise UsageError(f"unknown fault kind(s) {sorted(set(faults) - set(FAULTS))}")
    cfg = draw_config(seed, fixed)
    enabled = frozenset(applicable(cfg, faults))
    t0 = time.perf_counter()
    sim = _simulate(cfg, enabled, steps, None, wrap_runtime)
    report = report_of(sim, seed, steps, fixed, time.perf_counter() - t0)
    if shrink and not report.ok:
        prefix, failures = shortest_failing_prefix(cfg, enabled, steps, report.events,
                                                   wrap_runtime)
        report = attrs.evolve(report, failing_prefix=prefix, prefix_failures=failures)
    return report


def replay(seed: int, steps: int, events: Iterable[SimEvent],
           faults: frozenset[str] | None = None,
           wrap_runtime: Callable[[Any, str], Any] | None = None, **fixed: Any) -> Report:
    """Run exactly `events` (a recorded list, or a prefix of one), then drain."""
    cfg = draw_config(seed, fixed)
    enabled = frozenset(applicable(cfg, faults))
    t0 = time.perf_counter()
    sim = _simulate(cfg, enabled, steps, list(events), wrap_runtime)
    return report_of(sim, seed, steps, fixed, time.perf_counter() - t0)


def shortest_failing_prefix(cfg: SimConfig, faults: frozenset[str], steps: int,
                            events: tuple[SimEvent, ...],
                            wrap_runtime: Callable[[Any, str], Any] | None = None
                            ) -> tuple[tuple[SimEvent, ...], tuple[Failure, ...]]:
    """The shortest prefix of `events` that still fails when replayed and drained: bisection
    between a passing and a failing length, then a short walk below the passing one (a
    failure need not be monotone in the prefix length: an abort can hide a bug)."""
    def failures(n: int) -> tuple[Failure, ...]:
        return tuple(_simulate(cfg, faults, steps, events[:n], wrap_runtime).failures)

    hi, hi_failures = len(events), failures(len(events))
    if not hi_failures:  # cannot happen for a deterministic run; say so rather than guess
        raise RuntimeError("the recorded events did not fail on replay: nondeterminism")
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = failures(mid)
        if got:
            hi, hi_failures = mid, got
        else:
            lo = mid
    for n in range(lo - 1, max(-1, lo - 1 - SHRINK_WALK), -1):
        got = failures(n)
        if got:
            hi, hi_failures = n, got
    return events[:hi], hi_failures
