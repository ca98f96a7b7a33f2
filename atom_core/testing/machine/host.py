"""The host cache tier: spills, host hits, stores and loads that fail, busy slots and late
host events."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import precondition, rule

from atom_core.testing.lifecycle import Stats
from atom_core.testing.strategies import coin, num, pick


class HostRules:
    """A mixin of the core state machine (`MachineBase`'s attributes and helpers)."""

    # rules: host cache tier -------------------------------------------------------
    def slot(self, data: Any, label: str, among: list[int] | None = None) -> int:
        """A host slot: one of `among` when there are any, else any."""
        if among and num(data, 0, 3, f"{label}: any (0)"):
            return pick(data, among, label)
        return num(data, 0, self.c.H - 1, label)

    @precondition(lambda self: self.c.HOST)
    @rule(data=st.data(), k=st.integers(1, 8))
    def host_flow(self, data: Any, k: int) -> None:
        """Up to k host-tier steps (`host_step`)."""
        for _ in range(k):
            if not self.host_step(data, feed=True):
                return

    def host_step(self, data: Any, feed: bool) -> bool:
        """One host-tier step, whichever the draw picks among the possible ones: spill an
        entry (the policy's slot, or a drawn one) and let the store land, fail or stay in
        flight; a host hit (the policy's, or drawn parameters near one); end a store or a
        load in flight (it lands or fails: the request recomputes the loaded block); evict a
        host entry; a late or misdirected event (`late_host_event`). Whatever is left in
        flight is busy meanwhile (`busy_store`, `busy_load`, `busy_copy`). feed: also serve
        a request into the cache (`serve`). False if no step is possible."""
        life, c = self.life, self.c
        unpinned = [b for b in sorted(life.entries) if not life.pinned(b)]
        storing, stored = life.slots("STORING"), life.slots("STORED")
        loading = life.slots("LOADING")
        waiting, idle = self.waiting(), [l for l in range(c.B) if life.lane[l] is None]
        moves = ["late"] * 2 if life.entries or storing or stored or loading else []
        moves += ["spill"] * 3 if unpinned else []
        moves += ["store_done", "store_fail"] if storing else []
        moves += ["host_hit"] * 3 if stored and waiting and idle else []
        moves += ["load_done", "load_fail"] if loading else []
        moves += ["host_evict"] if stored else []
        if feed and idle:
            moves += ["serve"] * (3 if stored or not life.entries else 1)
        if not moves:
            return False
        move = pick(data, moves, "host move")
        if move == "spill":
            b = pick(data, unpinned, "entry")
            if not (coin(data, "the policy's slot") and self.spill_entry(data, b)):
                h = self.slot(data, "slot", life.slots("EMPTY"))
                if self.apply("spill", b, h).rejected is None:
                    self.busy_store(data, h)
        elif move in ("store_done", "store_fail"):
            h = pick(data, storing, "slot")
            b = life.slot_block[h]
            assert self.apply(move, h).rejected is None
            assert self.s.owner[b] == self.core.OWNER_FREE, b
        elif move == "host_hit":  # often a request that has one
            hits = [r for r in waiting
                    if self.policy.best_host_hit(self.s, self.s.prompt.get(r))]
            self.host_hit(data, pick(data, hits or waiting, "request"), idle)
        elif move in ("load_done", "load_fail"):
            l = life.slot_lane[pick(data, loading, "slot")]
            assert self.apply(move, l).rejected is None
        elif move == "host_evict":
            assert self.apply("host_evict", pick(data, stored, "slot")).rejected is None
        elif move == "late":
            self.late_host_event(data)
        else:
            self.serve(data)
        return True

    def serve(self, data: Any) -> None:
        """Serve one request into the cache: a waiting one, or a new one (usually extending
        a host entry's key, when there is one), by the real scheduler (`prefill_request`:
        admitted as the policy chooses, spilling the entry it evicts; its copy or load, and
        the stores of the spills, sometimes left in flight: meanwhile they are busy,
        `busy_copy`, and the copy or load ends here, a load may fail; paged tables: its next
        blocks grown, from the host tier when it holds more); then it decodes a few steps
        (sometimes to the block end) and the client finishes it, keeping its KV
        (`decode_request`)."""
        life, c = self.life, self.c
        if not self.waiting() or (life.slots("STORED") and num(data, 0, 3, "waiting (0)")):
            self.new_request(data, host=True)
            r = self.next_id - 1
        else:
            r = pick(data, self.waiting(), "request")
        self.local(r, first=True)
        busy: set[int] = set()

        def once_busy(l: int) -> None:
            """Right after its admission (its copy or load left in flight): `busy_copy`."""
            if l not in busy and life.copying[l]:
                busy.add(l)
                self.busy_copy(data, l)

        l = self.prefill_request(data, r, once_busy)
        if l is not None:
            self.decode_request(data, r, l, pick(data, (0, 1, 2, c.T * c.S), "tokens"))

    def host_hit(self, data: Any, r: int, idle: list[int]) -> None:
        """Admit waiting r from the host tier: when the policy's choice is a host hit, the
        scheduler's admissions up to it (`scheduler_step` up to its call, the load left in
        flight: busy, `busy_copy`), else drawn parameters near the longest host hit (another
        n, lane or dst, a slot without an entry; refused unless legal). The load it starts is
        busy (`busy_copy`). Paged tables: often a hit on a later block's host entry first
        (`refuse_later_host_hit`)."""
        s, c, life = self.s, self.c, self.life
        if c.T > 1 and num(data, 0, 3, "a later block's entry first (0)") == 0:
            self.refuse_later_host_hit(data, r)
        choice = self.policy.admission(s, r)
        if choice is not None and choice.action == "admit_host_hit" and coin(data, "policy"):
            self.local(r, first=True)
            for _ in range(2):  # (a spill's store may be left in flight first)
                if r in life.lane or not self.scheduler_step(None, in_flight=True, call=False):
                    break
            if r in life.lane:
                self.busy_copy(data, life.lane.index(r))
            return
        best = self.policy.best_host_hit(s, s.prompt.get(r))
        h, n = best if best is not None else (self.slot(data, "slot"), c.C)
        busy = [x for x in range(c.H) if s.slot_state[x] != self.core.SLOTSTATE_STORED]
        if busy and coin(data, "a slot without an entry"):  # refused: slot_stored
            h = pick(data, busy, "slot")
        n = pick(data, (n, n - c.C, n + c.C, n + 1, c.C), "n")
        l = pick(data, idle, "lane") if coin(data, "an idle lane") else self.lanes(
            data, lambda l: not s.busy[l])
        dst = self.policy.reusable(s)
        dst = dst if dst is not None and coin(data, "a reusable dst") else self.block(
            data, "dst")
        if self.apply("admit_host_hit", l, r, h, dst, n).rejected is None:
            self.busy_copy(data, l)

    def busy_store(self, data: Any, h: int) -> None:
        """A store into slot h is in flight: the slot may not be evicted, spilled into or
        hit (`busy_slot`)."""
        assert self.life.slot_state[h] == "STORING"
        self.busy_slot(data, h)

    def busy_slot(self, data: Any, h: int) -> None:
        """One of the calls a busy slot h refuses: an eviction, a spill into it, a hit on
        it."""
        life, c = self.life, self.c
        unpinned = [b for b in sorted(life.entries) if not life.pinned(b)]
        waiting, idle = self.waiting(), [l for l in range(c.B) if life.lane[l] is None]
        options = ["host_evict"] + (["spill"] if unpinned else [])
        options += ["admit_host_hit"] if waiting and idle else []
        what = pick(data, options, "while busy")
        state = life.slot_state[h]
        args = {"host_evict": (h,), "spill": (pick(data, unpinned or [0], "entry"), h),
                "admit_host_hit": (idle[0] if idle else 0, waiting[0] if waiting else 0, h,
                                   0, c.C)}[what]
        expect = "slot_empty" if what == "spill" else "slot_stored"
        assert self.apply(what, *args).rejected == expect
        Stats.events[f"{what} of a {state} slot rejected"] += 1

    def busy_copy(self, data: Any, l: int) -> None:
        """Lane l has just been admitted (or has grown by a hit past its first block).
        While its copy reads a device entry, the entry
        may not be spilled (nor discarded). While its load reads a slot, the slot may not
        be evicted, spilled into or hit (`busy_slot`), and copy_done is no way to end it;
        or the request ends (abort, failure) and the slot is a host entry again. Or nothing
        happens yet."""
        life = self.life
        src, h = life.copy_src[l], life.load_slot[l]
        if src is not None:
            what = pick(data, ("spill", "spill", "discard", "later"), "while copying")
            if what != "later":
                args = ((src, self.slot(data, "slot", life.slots("EMPTY")))
                        if what == "spill" else (src,))
                expect = "entry_unpinned" if what == "spill" else "not_pinned"
                assert self.apply(what, *args).rejected == expect
                Stats.events[f"{what} of a pinned entry rejected"] += 1
            return
        if h is None:
            return
        assert life.slot_state[h] == "LOADING"
        self.busy_slot(data, h)
        # (the first load an example finds in flight is cancelled: few are left in flight)
        what = pick(data, ("copy_done", "cancel", "later"), "then") if self.load_cancelled \
            else "cancel"
        if what == "cancel":
            self.load_cancelled = True
            how = pick(data, ("abort_running", "fail"), "how")
            assert self.apply(how, l).rejected is None
            assert self.s.slot_state[h] == self.core.SLOTSTATE_STORED, h  # intact, evictable
        elif what == "copy_done":  # a load ends by load_done or load_fail
            assert self.apply("copy_done", l).rejected == "copy_in_flight"
            Stats.events["copy_done of a load rejected"] += 1

    def late_host_event(self, data: Any) -> None:
        """A store or load event for a slot or lane that has none in flight, an eviction
        of an empty slot, a hit on a slot that holds no entry, a spill of a block that is
        no cache entry: refused, changing nothing."""
        life, c = self.life, self.c
        quiet = [h for h in range(c.H) if life.slot_state[h] != "STORING"]
        unloaded = [l for l in range(c.B) if life.load_slot[l] is None]
        empty = life.slots("EMPTY")
        waiting, idle = self.waiting(), [l for l in range(c.B) if life.lane[l] is None]
        options = ["store"] if quiet else []
        options += ["load"] if unloaded else []
        options += ["evict"] if empty else []
        options += ["hit"] if waiting and idle and len(life.slots("STORED")) < c.H else []
        options += ["not_an_entry"] if len(life.entries) < c.K else []
        kind = pick(data, options, "late host event")
        if kind == "store":
            call, args, expect = pick(data, ("store_done", "store_fail")), (
                pick(data, quiet, "slot"),), "slot_storing"
        elif kind == "load":
            call, args, expect = pick(data, ("load_done", "load_fail")), (
                pick(data, unloaded, "lane"),), "load_in_flight"
        elif kind == "evict":
            call, args, expect = "host_evict", (pick(data, empty, "slot"),), "slot_stored"
        elif kind == "hit":  # an empty, storing or loading slot, with its key's first chunk
            h = pick(data, [h for h in range(c.H) if life.slot_state[h] != "STORED"])
            r, l = pick(data, waiting, "request"), pick(data, idle, "lane")
            call, args = "admit_host_hit", (l, r, h, 0, c.C)
            expect = "slot_stored"
        else:  # a lane's, free, scratch, draining or spilling block
            b = pick(data, [b for b in range(c.K) if b not in life.entries], "block")
            call, args, expect = "spill", (b, self.slot(data, "slot")), "entry_cached"
        out = self.apply(call, *args)
        assert out.rejected == expect, (call, args, out.rejected, expect)
        Stats.events[f"late {call} rejected"] += 1
