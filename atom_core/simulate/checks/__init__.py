"""The checks run after every tick, one rule per module, each `(server) -> problems`:
`invariants` (the core's invariants; reported as invariant violations) and the leak rules in
`LEAK_CHECKS`; `endings` runs when a request ends, `at_rest` after the drain. A new leak rule is
one more module here and one more entry in `LEAK_CHECKS`."""

from __future__ import annotations

from collections.abc import Callable

from atom_core.simulate.checks.blocks import batcher_leaks
from atom_core.simulate.checks.host_tier import host_tier_leaks
from atom_core.simulate.checks.prefetch import prefetch_leaks
from atom_core.simulate.checks.snapshots import snapshot_leaks
from atom_core.simulate.servers import Server

# Run in this order after every tick: a run's failures list them in it.
LEAK_CHECKS: tuple[Callable[[Server], list[str]], ...] = (batcher_leaks, prefetch_leaks,
                                                          host_tier_leaks, snapshot_leaks)
