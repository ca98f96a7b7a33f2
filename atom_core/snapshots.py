"""Host copies of hybrid lanes' sliding-window state, for the prefix cache (the adapter's side).

The core decides which snapshots exist: a lane has one at every chunk boundary up to
`lane_snap[lane]`, a cache entry (and, with paged tables, a lane's full block, which becomes
one when its request ends) at every boundary up to `snap_upto[block]`. This store only holds
the host buffers for the ones a hit can read (those past the block's start, `sync`), moving
them along the transitions the core takes: a lane's snapshots become a full block's when it
fills and its tail's entry's when it is cached, and a hit hands the entry's (up to the hit's
end) to the lane that hit. Buffers are never written after they are taken, so lanes and entries
may share one.
"""

from __future__ import annotations

from typing import Any

from atom_core._generated import core

Snaps = dict[int, Any]  # chunk boundary n -> host buffer of the slot's state after n tokens


class SnapshotStore:
    def __init__(self) -> None:
        self.lanes: dict[int, Snaps] = {}
        self.entries: dict[int, Snaps] = {}

    def taken(self, lane: int, n: int, host: Any) -> None:
        self.lanes.setdefault(lane, {})[n] = host

    def restore_source(self, src: int, n: int) -> Any:
        """The buffer a hit of n tokens from entry src restores (the core guarantees it)."""
        return self.entries[src][n]

    def sync(self, s: core.State) -> None:
        """Drop what the core no longer has: snapshots of idle lanes and of blocks that are
        neither cache entries nor full lane blocks, and any past the core's boundary (after a
        hit, a lane keeps its entry's only up to the hit's end).

        Also drop what no hit can read: a hit on entry b restores at a boundary n with
        start[b] < n (an admission's n >= C into a first block, a `grow_hit`'s length + n past
        the block's start), so an entry keeps only its own block's boundaries, and a lane only
        those of its tail (the ones `filled` and `released` hand on). Keeping every earlier
        boundary too made each later block of a long prompt hold the whole prompt's snapshots:
        up to max_seq_len / chunk host copies of a local slot per entry instead of
        block_size / chunk, still alive after the entries they belong to were evicted."""
        self.lanes = {ln: _within(sn, s.start[s.tail[ln]], s.lane_snap[ln])
                      for ln, sn in self.lanes.items() if s.busy[ln]}
        self.entries = {b: _within(sn, s.start[b], s.snap_upto[b])
                        for b, sn in self.entries.items()
                        if s.owner[b] == core.OWNER_CACHE or (
                            s.owner[b] == core.OWNER_LANE and s.tail[s.owner_lane[b]] != b)}

    def admitted(self, lane: int, src: int | None) -> None:
        """A lane takes a new request: no snapshots, or (a hit) the entry's."""
        self.lanes[lane] = dict(self.entries.get(src, {})) if src is not None else {}

    def filled(self, lane: int, block: int) -> None:
        """Paged tables: the lane's block `block` is full; it keeps the lane's snapshots so far
        (`sync` trims them to the core's `snap_upto`), ready for when it is cached."""
        self.entries[block] = dict(self.lanes.get(lane, {}))

    def released(self, lane: int, block: int) -> None:
        """The lane's request ended and its block was released; if it became a cache entry, the
        lane's snapshots are now the entry's (`sync` trims them to the core's `snap_upto`)."""
        self.entries[block] = self.lanes.pop(lane, {})

    def count(self) -> int:
        return sum(map(len, self.lanes.values())) + sum(map(len, self.entries.values()))


def _within(snaps: Snaps, start: int, n: int) -> Snaps:
    """The snapshots at boundaries in (start, n]."""
    return {k: v for k, v in snaps.items() if start < k <= n}
