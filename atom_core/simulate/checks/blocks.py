"""Blocks between ticks: none outside a live request, a recorded transfer, the cache or scratch;
the core's waiting requests are the queue."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atom_core._generated import core

if TYPE_CHECKING:
    from atom_core.batcher import AtomBatcher
    from atom_core.simulate.servers import Server


def block_leaks(side: str, b: AtomBatcher) -> list[str]:
    """Every block is free, cached, scratch, held by a busy lane whose request has not ended,
    or draining for a recorded transfer of an ended request; every recorded transfer pins its
    block; every request the core has waiting is in the batcher's queue."""
    s, out = b.state, []
    transfers = b.transfers()  # request -> its first block: a transfer may pin several
    tables = [ln["blocks"] for ln in b.describe()["lanes"]]
    for blk in range(s.consts.K):
        own = s.owner[blk]
        if own in (core.OWNER_FREE, core.OWNER_CACHE, core.OWNER_SCRATCH):
            continue
        if own == core.OWNER_LANE:
            ln = s.owner_lane[blk]
            if not (s.busy[ln] and blk in tables[ln]):
                out.append(f"{side}: block {blk} is owned by lane {ln}, which does not hold it")
            elif b.requests[s.lane_req[ln]].ended:
                out.append(f"{side}: block {blk} is held by lane {ln} for request "
                           f"{s.lane_req[ln]}, which has ended")
        elif own == core.OWNER_DRAINING:
            r = s.transfer_req[blk]
            if r not in transfers:
                out.append(f"{side}: block {blk} drains with no recorded transfer")
            elif not b.requests[r].ended:
                out.append(f"{side}: block {blk} drains for request {r}, which has not ended")
        elif own == core.OWNER_SPILLING:  # the adapter stores a block within a step
            out.append(f"{side}: block {blk} is still spilling into host slot "
                       f"{s.spill_slot[blk]} between ticks")
        else:
            out.append(f"{side}: block {blk} has unknown owner {own}")
    for r, blk in transfers.items():
        if s.owner[blk] not in (core.OWNER_LANE, core.OWNER_DRAINING):
            out.append(f"{side}: the transfer of request {r} names block {blk}, which is "
                       f"{core.OWNER_NAMES[s.owner[blk]]}")
    core_waiting = sorted(r for r, ph in s.phase.items() if ph == core.PHASE_WAITING)
    if core_waiting != sorted(b.waiting):
        out.append(f"{side}: the core has requests {core_waiting} waiting, the queue "
                   f"{sorted(b.waiting)}")
    return out


def batcher_leaks(server: Server) -> list[str]:
    return [m for side, b in server.batchers().items() for m in block_leaks(side, b)]
