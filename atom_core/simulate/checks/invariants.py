"""The core's invariants (ghost state on) on every batcher's state, after every transition."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atom_core._generated import core

if TYPE_CHECKING:
    from atom_core.simulate.servers import Server


def invariant_violations(server: Server) -> list[str]:
    """The invariants `core.check_invariants` names as violated, one line per side."""
    out = []
    for side, b in server.batchers().items():
        bad = core.check_invariants(b.state)
        if bad:
            out.append(f"{side}: {', '.join(bad)}")
    return out
