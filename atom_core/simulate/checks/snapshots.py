"""Hybrid prefix cache: the adapter's snapshot buffers are the core's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atom_core._generated import core

if TYPE_CHECKING:
    from atom_core.simulate.servers import Server


def snapshot_leaks(server: Server) -> list[str]:
    """Hybrid prefix cache: the snapshot buffers the adapter holds (`describe()["snapshots"]`)
    are exactly the core's that a hit can read: a busy lane l's at the chunk boundaries past
    its tail block's start up to lane_snap[l], a cache entry b's past start[b] up to
    snap_upto[b] (a hit restores past the block's start; the earlier ones are the blocks
    before's); none for an idle lane or a block that is not a cache entry (each buffer is a
    local slot's worth of host memory)."""
    out = []
    for side, b in server.batchers().items():
        s = b.state
        if not (s.consts.HYBRID and s.consts.PREFIX):
            continue
        snaps = b.describe()["snapshots"]
        if snaps is None:
            out.append(f"{side}: a hybrid prefix cache, but describe() reports no snapshots")
            continue
        c = s.consts.C
        for kind, held, upto, live, start in (
                ("lane", snaps["lanes"], s.lane_snap, s.busy, [s.start[t] for t in s.tail]),
                # cache entries, and full lane blocks (they keep their lane's snapshots; an
                # importing lane's have none: importing_blocks_have_no_snapshots)
                ("block", snaps["entries"], s.snap_upto,
                 [o == core.OWNER_CACHE or (o == core.OWNER_LANE and s.tail[s.owner_lane[b]] != b)
                  for b, o in enumerate(s.owner)], s.start)):
            for i in sorted(set(held) | set(range(len(upto)))):
                ok = 0 <= i < len(upto) and live[i]
                want = [k for k in range(c, upto[i] + 1, c) if k > start[i]] if ok else []
                got = list(held.get(i, []))
                if got != want:
                    why = "" if ok else (" (idle)" if kind == "lane" else
                                         " (neither a cache entry nor a full lane block)")
                    out.append(f"{side}: the adapter holds snapshots of {kind} {i}{why} at "
                               f"{got}, the core {want}")
    return out
