"""What a run reports (`Report`), and the report as text (`render`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

from atom_core.simulate.dimensions import DIMENSIONS, SimConfig
from atom_core.simulate.events import Failure, SimEvent
from atom_core.simulate.faults import applicable

if TYPE_CHECKING:
    from atom_core.simulate.driver import Sim


@attrs.frozen
class Report:
    """The outcome of one run. Equality ignores timings: a replay must compare equal."""

    seed: int
    steps: int
    config: dict[str, Any]
    faults: tuple[str, ...]  # the kinds enabled
    requests: int
    completed: int
    errors: int
    aborted: int
    faults_injected: int
    faults_by_kind: dict[str, int]
    invariant_violations: int
    leaks: int
    token_mismatches: int
    lifecycle_errors: int
    drain_cap_hit: bool
    crash: str | None
    ticks: int
    events: tuple[SimEvent, ...]
    failures: tuple[Failure, ...]
    failing_prefix: tuple[SimEvent, ...] | None = None
    prefix_failures: tuple[Failure, ...] = ()
    fixed: dict[str, Any] = attrs.Factory(dict)
    batcher_stats: dict[str, dict[str, int]] = attrs.Factory(dict)  # by side: what was covered
    router_errors: int = 0  # cluster: the router's choices or bookkeeping against the truth
    cluster: dict[str, int] = attrs.Factory(dict)  # cluster: kills, restarts, retries, ...
    seconds: float = attrs.field(default=0.0, eq=False)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        head = f"seed {self.seed}, {self.steps} steps"
        if self.ok:
            return f"{head}: ok"
        more = f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
        return f"{head}: FAILED {self.failures[0]}{more}; replay: {self.replay_command()}"

    @property
    def steps_per_second(self) -> float:
        return round(self.ticks / self.seconds, 1) if self.seconds > 0 else 0.0

    def replay_command(self) -> str:
        argv = ["atom-core", "simulate", "--seed", str(self.seed), "--steps", str(self.steps)]
        if set(self.faults) != applicable(self.config_obj(), None):
            argv += ["--faults", ",".join(self.faults) or "none"]
        for name, value in self.fixed.items():
            argv += ["--set", f"{name}={'none' if value is None else value}"]
        return " ".join(argv)

    def config_obj(self) -> SimConfig:
        return SimConfig(seed=self.seed, **{d.name: self.config.get(d.name)
                                            for d in DIMENSIONS if d.name in self.config})

    def as_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed, "steps": self.steps, "ok": self.ok, "config": self.config,
            "requests": self.requests, "completed": self.completed, "errors": self.errors,
            "aborted": self.aborted, "faults_injected": self.faults_injected,
            "faults_by_kind": self.faults_by_kind,
            "invariant_violations": self.invariant_violations, "leaks": self.leaks,
            "token_mismatches": self.token_mismatches, "lifecycle_errors": self.lifecycle_errors,
            "drain_cap_hit": self.drain_cap_hit, "crash": self.crash, "ticks": self.ticks,
            "events": len(self.events), "failures": [str(f) for f in self.failures[:20]],
            "failing_prefix": None if self.failing_prefix is None
            else [e.as_json() for e in self.failing_prefix],
            "failing_prefix_events": None if self.failing_prefix is None
            else len(self.failing_prefix),
            "prefix_failures": [str(f) for f in self.prefix_failures[:20]],
            "replay": self.replay_command(), "batcher_stats": self.batcher_stats,
            **({"router_errors": self.router_errors, "cluster": self.cluster}
               if self.cluster else {}),
            "seconds": round(self.seconds, 3), "steps_per_second": self.steps_per_second,
        }


def report_of(sim: Sim, seed: int, steps: int, fixed: dict[str, Any], seconds: float) -> Report:
    """The report of a run `sim` has played."""
    kinds = Counter(f.kind for f in sim.failures)
    ends = Counter(o[0] for o in sim.outcomes.values() if o)
    crash = next((f.detail for f in sim.failures if f.kind == "crash"), None)
    return Report(
        seed=seed, steps=steps, config=sim.cfg.as_json(), faults=tuple(sorted(sim.faults)),
        requests=len(sim.submitted), completed=ends["finished"], errors=ends["error"],
        aborted=ends["abort"], faults_injected=sum(sim.injected.values()),
        faults_by_kind={k: sim.injected[k] for k in sorted(sim.faults)},
        invariant_violations=kinds["invariant"], leaks=kinds["leak"],
        token_mismatches=kinds["token"], lifecycle_errors=kinds["lifecycle"],
        drain_cap_hit=bool(kinds["drain"]), crash=crash, ticks=sim.tick_no,
        events=tuple(sim.events), failures=tuple(sim.failures), fixed=dict(fixed),
        batcher_stats={side: attrs.asdict(b.stats) for side, b in sim.server.batchers().items()},
        router_errors=kinds["router"], cluster=sim.server.counters(),
        seconds=seconds)


def render(report: Report) -> str:
    """A report as text for the terminal."""
    c = report.config
    lines = [f"atom-core simulate: seed {report.seed}, {report.steps} steps "
             f"({report.ticks} ticks with the drain, {report.steps_per_second} ticks/s)",
             "  config: " + ", ".join(f"{k}={v}" for k, v in c.items()),
             f"  requests: {report.requests} ({report.completed} finished, {report.errors} "
             f"failed, {report.aborted} aborted)",
             f"  faults injected: {report.faults_injected} ("
             + (", ".join(f"{k} {n}" for k, n in report.faults_by_kind.items()) or "none")
             + ")",
             f"  checks: {report.invariant_violations} invariant violations, {report.leaks} "
             f"leaks, {report.token_mismatches} token mismatches, {report.lifecycle_errors} "
             f"lifecycle errors" + (", drain cap hit" if report.drain_cap_hit else "")
             + (f", crash: {report.crash}" if report.crash else "")]
    if report.cluster:
        lines.insert(3, "  cluster: " + ", ".join(f"{k} {n}" for k, n in report.cluster.items())
                     + f"; {report.router_errors} router errors")
    if c.get("host_cache_blocks") or c.get("prefill_host_cache_blocks"):
        st = {k: sum(v.get(k, 0) for v in report.batcher_stats.values()) for k in
              ("host_stores", "host_store_failures", "host_hit_tokens", "host_load_failures")}
        lines.insert(3, f"  host tier: {st['host_stores']} stores ({st['host_store_failures']} "
                     f"failed), {st['host_hit_tokens']} tokens loaded "
                     f"({st['host_load_failures']} loads failed)")
    if report.ok:
        lines.append("OK")
        return "\n".join(lines)
    lines.append("FAILED:")
    lines += [f"  {f}" for f in report.failures[:10]]
    if report.failing_prefix is not None:
        p = report.failing_prefix
        ticks = sum(1 for e in p if e.kind == "step")
        lines.append(f"shortest failing prefix: {len(p)} of {len(report.events)} events "
                     f"({ticks} ticks), then the drain:")
        lines += [f"  {e}" for e in _compact(p)]
        lines += [f"  -> {f}" for f in report.prefix_failures[:5]]
    lines.append(f"replay: {report.replay_command()}")
    return "\n".join(lines)


def _compact(events: Iterable[SimEvent]) -> list[str]:
    """Events as lines, consecutive steps folded into one ("step x5")."""
    out: list[str] = []
    run_len = 0
    for e in events:
        if e.kind == "step":
            run_len += 1
            continue
        if run_len:
            out.append("step" if run_len == 1 else f"step x{run_len}")
            run_len = 0
        out.append(str(e))
    if run_len:
        out.append("step" if run_len == 1 else f"step x{run_len}")
    return out
