"""`atom-core simulate`: a seeded, deterministic simulation of the batcher under faults.

One seed picks a configuration (colocated or PD, prefix cache, host cache tier, scratch
discipline, hybrid sliding window, lanes, blocks, ...; any of them can be fixed) and a workload
(with a host tier: more shared prefixes than the device cache holds), then drives the
batcher (colocated) or a PD prefill worker and decode worker (over `InProcessTransport.pair()`)
on the tiny torch reference runtime for `steps` ticks while injecting faults: runtime calls that
raise, transfer delays, drops, duplicates, late and corrupted messages, a lost prefill worker,
client aborts. Then it stops injecting and drains: every request must end. Cluster mode
(`mode=cluster`, never drawn) drives a `LocalCluster` of 1..3 prefill and 1..3 decode workers
and its router instead, with workers killed, restarted and joining late (not ready at first,
sometimes) and prefill workers that refuse requests when full; see `checks/cluster.py` for what
it checks beyond the per-batcher rules below.

What is checked, through public APIs only (the batcher's `state` is read, never written):

- after every tick: `core.check_invariants` on every batcher's core state (ghost state on), and
  no leak: every block is free, cached, the scratch block, held by a busy lane serving a request
  that has not ended, or draining for a recorded transfer of an ended request; every recorded
  transfer names a pinned block; every waiting request is queued; a decode worker holds
  prefetched KV only for requests that still wait; between ticks no host-tier store or load is
  in flight (no slot storing or loading, no block spilling: the adapter does them within a
  step), and every host slot's state and tokens in `describe()` are the core's; the hybrid
  prefix cache's snapshot buffers the adapter holds (`describe()["snapshots"]`) are exactly the
  core's: a busy lane's at every chunk boundary up to `lane_snap`, a cache entry's up to
  `snap_upto`, nothing for idle lanes or other blocks;
- when a request ends: it ends exactly once (finished, error or abort), a finished request's
  tokens are exactly the oracle's greedy tokens for its prompt, and an ended one emitted a prefix
  of them;
- after the drain (capped: hitting the cap is a failure): every request ended, every block is
  at rest (free, cached or scratch) and every host slot is empty or stored.

Every decision comes from `random.Random` seeded by the seed, and runs are replayed from their
recorded event list: `submit`, `step` (one tick: one step of each worker) and one event per
injected fault. The first failure stops a run; its shortest failing prefix is found by replaying
prefixes of the event list (each followed by the drain). The decode worker's clock (its
transfer timeout) is a simulated one (one second per tick, `DecodeWorker(clock=...)`), so a
timeout fires at the same tick in every replay; the workers' batchers keep ghost state
(`ghost=True`).

The package, one part per module (each imports only the ones above it):

    dimensions      SimConfig, DIMENSIONS, draw_config, --set parsing, the batcher Configs
    model           the model the servers compute with and its oracle, from the runtime registry
    events          SimEvent (what a run records and replays) and Failure
    workload        the requests a seed submits
    faulty_runtime  FaultyRuntime: runtime calls that scribble, then raise
    faulty_link     SimLink: PD messages dropped, duplicated, corrupted, late
    servers         Colocated, Disaggregated (PD prefill + decode worker), Clustered
                    (LocalCluster: prefill and decode workers behind the router), SimClock
    faults          FAULTS: each fault kind's when, draw and apply; --faults parsing
    checks/         one rule per module: invariants, blocks, prefetch, host_tier, snapshots
                    (after every tick), endings (when a request ends), at_rest (after the drain),
                    cluster (cluster mode: the router against the workers; why a request fails)
    report          Report, render
    driver          Sim (one run: events in, checks after each tick, the drain), run, replay,
                    shortest_failing_prefix
    deep            deep mode: sweep over consecutive seeds

Extending: a new feature is one more entry in `DIMENSIONS` (and a field of `SimConfig` whose
default is "off"), a new fault one more entry in `FAULTS`, a new leak rule one more module in
`checks/` and one more function in `LEAK_CHECKS`. `run` is the programmatic entry point (it
never prints); `render` formats a report, `sweep` runs consecutive seeds. This package
re-exports the entry points; the parts live in their modules.
"""

from __future__ import annotations

from atom_core.simulate.deep import SweepResult, sweep, sweep_with_progress
from atom_core.simulate.dimensions import (
    DIMENSIONS,
    SimConfig,
    UsageError,
    draw_config,
    host_cache_allowed,
    hybrid_prefix_cache_allowed,
    parse_fixed,
)
from atom_core.simulate.driver import replay, run, shortest_failing_prefix
from atom_core.simulate.events import Failure, SimEvent
from atom_core.simulate.faults import FAULTS, parse_faults
from atom_core.simulate.report import Report, render

__all__ = ["DIMENSIONS", "FAULTS", "Failure", "Report", "SimConfig", "SimEvent", "SweepResult",
           "UsageError", "draw_config", "host_cache_allowed", "hybrid_prefix_cache_allowed",
           "parse_faults", "parse_fixed", "render", "replay", "run", "shortest_failing_prefix",
           "sweep", "sweep_with_progress"]
