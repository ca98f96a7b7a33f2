"""`simulate --html`: a seed's run played again from its recorded events (runs replay exactly:
shrinking relies on it) with every batcher's transitions recorded, then drawn as one timeline
per batcher with the run's ticks, injected faults and failed checks marked. The replay must
end as the run did (the same failures at the same ticks), or there is no picture: it would not
be of the run the report describes."""

from __future__ import annotations

from collections import defaultdict
from typing import IO, cast

from atom_core.simulate.dimensions import SimConfig, UsageError, draw_config
from atom_core.simulate.driver import Sim
from atom_core.simulate.events import SimEvent
from atom_core.simulate.report import Report, report_of
from atom_core.viz import Mark, Timeline, timeline_of_trace

SIDES = {"local": "colocated batcher", "decode": "decode worker", "prefill": "prefill worker"}


class _Tap:
    """A batcher's trace, kept as its lines (the scheduler writes one line per write)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)

    @property
    def state(self) -> int:
        """The index of the batcher's current state in its timeline (the first line is the
        constants, each further one a step)."""
        return len(self.lines) - 1


class TracedSim(Sim):
    """A Sim whose batchers write traces, noting where in them each tick, fault and failure
    falls."""

    def __init__(self, cfg: SimConfig, faults: frozenset[str], steps: int) -> None:
        self.taps: dict[str, _Tap] = {}  # (filled while Sim builds the servers)
        self.marks: dict[str, list[Mark]] = defaultdict(list)
        self.labels: dict[str, dict[int, str]] = defaultdict(dict)  # state -> its tick
        self._seen: dict[str, int] = defaultdict(int)  # the last state labelled, per side
        super().__init__(cfg, faults, steps)

    def trace_sink(self, side: str) -> IO[str] | None:
        return cast(IO[str], self.taps.setdefault(side, _Tap()))

    def apply(self, ev: SimEvent) -> None:
        super().apply(ev)
        if ev.kind not in ("step", "submit"):
            for side, tap in self.taps.items():
                self.marks[side].append(Mark(tap.state, "fault",
                                             f"after tick {self.tick_no}: fault {ev}"))

    def tick(self) -> None:
        super().tick()
        for side, tap in self.taps.items():
            for i in range(self._seen[side] + 1, tap.state + 1):
                self.labels[side][i] = f"tick {self.tick_no}"
            self._seen[side] = tap.state

    def fail(self, kind: str, detail: str) -> None:
        super().fail(kind, detail)
        for side, tap in self.taps.items():
            self.marks[side].append(Mark(tap.state, "check", str(self.failures[-1])))


def timelines(report: Report) -> list[Timeline]:
    """The timelines of `report`'s run: one per batcher (colocated: one; PD: the decode and the
    prefill worker's). UsageError for cluster mode (its workers' batchers are built inside the
    cluster, which records no trace); ValueError if the replay does not end as the run did."""
    cfg = draw_config(report.seed, report.fixed)
    if cfg.cluster:
        raise UsageError("--html draws colocated and pd runs; a cluster run's workers keep "
                         "no trace")
    sim = TracedSim(cfg, frozenset(report.faults), report.steps)
    sim.play(list(report.events))
    again = report_of(sim, report.seed, report.steps, report.fixed, 0.0)
    if (again.failures, again.ticks) != (report.failures, report.ticks):
        raise ValueError(f"the traced replay of seed {report.seed} ended otherwise than the run "
                         f"({again.ticks} ticks, {len(again.failures)} failures; the run: "
                         f"{report.ticks}, {len(report.failures)})")
    return [timeline_of_trace(tap.lines, name=SIDES.get(side, side),
                              labels=sim.labels[side]).with_marks(sim.marks[side])
            for side, tap in sorted(sim.taps.items(), key=lambda kv: list(SIDES).index(kv[0])
                                    if kv[0] in SIDES else 9)]
