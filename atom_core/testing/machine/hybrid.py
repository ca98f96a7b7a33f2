"""The hybrid tier (sliding-window layers): snapshots at the right and at wrong times,
hits only as deep as the entry's snapshots."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import precondition, rule

from atom_core.seq import seq
from atom_core.testing.strategies import coin, pick, token_lists


class HybridRules:
    """A mixin of the core state machine (`MachineBase`'s attributes and helpers)."""

    # rules: hybrid prefix cache ---------------------------------------------------
    @precondition(lambda self: self.c.HYBRID)
    @rule(data=st.data(), k=st.integers(1, 8))
    def hybrid_flow(self, data: Any, k: int) -> None:
        """Up to k hybrid steps (`hybrid_step`)."""
        for _ in range(k):
            if not self.hybrid_step(data):
                return

    def hybrid_step(self, data: Any) -> bool:
        """One hybrid prefix cache step, whichever the draw picks among the possible ones:
        a snapshot of a lane at its next chunk boundary (accepted) or at a wrong time
        (refused: an idle, copying, importing or exporting lane, one short of its next
        boundary or past it, a boundary having been skipped); the next turn of a cached
        conversation (it matches further than the entry's snapshots reach); a hit past
        the snapshots (refused) or as deep as they go, at an admission or (paged tables)
        past the first block (`grow_hit`, from the entry at a lane's boundary); or to get
        there: submit, complete a copy, a step of the real scheduler (`scheduler_step`: it
        grows the lanes, admits as the policy chooses, prefills, snapshotting as the policy
        does, or decodes: generated tokens have no snapshots; a copy often left in flight)
        or finish into the cache. False if no step is possible."""
        life, c = self.life, self.c
        ready = [l for l in range(c.B) if life.snapshot_ok(l)]
        past = self.hits_past_snapshot()
        later_past = self.later_hits_past_snapshot()
        beyond = [b for b, (key, snap) in life.entries.items() if len(key) >= snap + c.C]
        waiting, idle = self.waiting(), [l for l in range(c.B) if life.lane[l] is None]
        prefilling = [l for l in range(c.B) if life.prefilling(l) and not life.copying[l]]
        decoding = [l for l in range(c.B) if life.decoding(l)]
        moves = ["snapshot"] * 3 if ready else []
        moves += ["bad_snapshot"]
        moves += ["past"] * 3 if past and idle else []
        moves += ["later_past"] * 3 if later_past else []
        moves += ["next_turn"] * 2 if beyond else []
        moves += ["submit"] if not waiting else []
        moves += ["step"] * 2 if waiting and idle else []
        moves += ["copy_done"] if any(x is not None for x in life.copy_src) else []
        moves += ["step"] * 2 if prefilling else []
        moves += ["step", "finish", "finish"] if decoding else []
        move = pick(data, moves, "hybrid move")
        if move == "snapshot":
            assert self.apply("snapshot", pick(data, ready, "lane")).rejected is None
        elif move == "bad_snapshot":
            l = self.lanes(data, lambda l: not life.snapshot_ok(l))
            ok = life.snapshot_ok(l)
            assert (self.apply("snapshot", l).rejected is None) == ok
        elif move == "past":
            r, src, n = pick(data, past, "request, entry, n")
            snap = self.s.snap_upto[src]
            if coin(data, "as deep as the snapshots go"):
                n = snap  # 0: no snapshot at all (n_whole_chunks)
            dst = self.policy.reusable(self.s, exclude=src)
            dst = self.block(data, "dst", src) if dst is None else dst
            out = self.apply("admit_hit", pick(data, idle, "lane"), r, src, dst, n)
            if n > snap:  # every other guard holds
                assert out.rejected == "hybrid_snapshot_at_n", out.rejected
        elif move == "later_past":
            l, src, n = pick(data, later_past, "lane, entry, n")
            upto = self.s.snap_upto[src] - life.length[l]
            if coin(data, "as deep as the snapshots go"):
                n = upto  # <= 0: no snapshot past the boundary (n_whole_chunks)
            dst = self.policy.reusable(self.s, exclude=src)
            dst = self.block(data, "dst", src) if dst is None else dst
            out = self.apply("grow_hit", l, src, dst, n)
            if n > upto:  # every guard before it holds
                assert out.rejected == "hybrid_snapshot_at_n", out.rejected
        elif move == "next_turn":
            key = life.entries[pick(data, beyond, "entry")][0]
            tail = data.draw(token_lists(1, c.S), label="tail")
            p = seq((key + tuple(tail))[:c.T * c.S - 1])
            assert self.apply("submit", self.next_id, p).rejected is None
            self.next_id += 1
        elif move == "submit":
            self.new_request(data)
        elif move == "copy_done":
            self.apply("copy_done", next(l for l in range(c.B)
                                         if life.copy_src[l] is not None))
        elif move == "step":
            return self.scheduler_step(data, in_flight=True)
        else:
            self.apply("finish", pick(data, decoding, "lane"), True)
        return True
