"""The end of every run: a tier's actions refused where it is absent, the drain (every
request to its end), PD with paged tables, and forgetting every ended request."""

from __future__ import annotations

import pytest

from atom_core._generated import core as committed
from atom_core.seq import seq
from atom_core.testing.lifecycle import (
    ALPHABET,
    ENDED,
    HYBRID_HIT_EVICTED,
    IMPORT_SHORT,
    NO_SLOT,
    STEMS,
    Stats,
)


class TeardownRules:
    """A mixin of the core state machine (`MachineBase`'s attributes and helpers)."""

    def foreign_tier_calls(self) -> None:
        """Whatever state a run ends in, a configuration refuses the actions of a tier it
        does not have: without the hybrid prefix cache every snapshot, without the host
        tier every spill and host hit past the first block (H = 0: the core refuses the
        slot index, there being none) and every load event (no lane is loading), without
        PREEMPT every preemption, without the prefix cache or with tables of one block
        every hit past the first block (by the guard the lifecycle model names: an idle,
        decoding or copying lane, a tail not full (T = 1: a prefilling lane's never is), no
        entry). With PREEMPT (PD runs with it too), an import of a request submitted for it
        (and aborted): refused while an importing table grows (one grows at a time), else
        into a block it may not take (refused by dst_reusable alone, so no run without PD
        admits one)."""
        c, life = self.c, self.life
        if not (c.PREFIX and c.T > 1):
            for l in range(c.B):
                assert self.apply("grow_hit", l, 0, 0, c.C).rejected is not None
        if not (c.HYBRID and c.PREFIX):
            for l in range(c.B):
                assert self.apply("snapshot", l).rejected == "hybrid_prefix_cache"
        if not c.HOST:
            # (H = 0: there is no slot to name, and the core refuses the index by name
            # before any guard runs, in the action, its guard and its plan alike)
            for b in range(c.K):
                for fn in (self.core.spill, self.core.spill_guard, self.core.spill_plan):
                    with pytest.raises(IndexError, match="spill: h=0 is not a Slot"):
                        fn(self.s, b, 0)
            for l in range(c.B):
                assert life.load_slot[l] is None  # nothing to load from
                assert self.apply(("load_done", "load_fail")[l % 2], l).rejected == (
                    "load_in_flight")
                with pytest.raises(IndexError, match="grow_host_hit: h=0 is not a Slot"):
                    self.core.grow_host_hit(self.s, l, 0, 0, c.C)
            Stats.events[NO_SLOT] += 1
        if not c.PREEMPT:
            for l in range(c.B):
                assert self.apply("preempt", l).rejected == "preemption_on"
        elif None in life.lane and (life.import_table_grows() or not all(
                map(life.reusable, range(c.K)))):
            # (a request of its own, aborted at once: an id the run's steps never name, so
            # that the rest of the teardown runs as it would without it)
            r = 10**6 + self.next_id
            assert self.apply("submit", r, seq(STEMS[0][:1])).rejected is None
            grows = life.import_table_grows()
            dst = 0 if grows else min(b for b in range(c.K) if not life.reusable(b))
            out = self.apply("admit_import", life.lane.index(None), r, dst)
            assert out.rejected == ("one_import_table_growing" if grows
                                    else "dst_reusable"), out.rejected
            assert self.apply("abort_waiting", r).rejected is None

    def teardown(self) -> None:
        """Drain as a scheduler runs until idle: end every transfer, copy, load and store
        (some loads and stores fail), complete imports and exports, run each request to
        its end (prefill; with pd, some are exported; some decode to the table end; finish
        into the cache; a quarter are aborted or failed instead) and admit the waiting ones
        as the policy chooses (every third abandoned instead); paged tables with the prefix
        cache: then a miss beside a cached later block (`miss_beside_later_block`), drained
        too; with pd and paged tables, two transfers of several blocks
        (`paged_transfers`); then check each request ended exactly once and nothing is left
        in flight.
        With preemption, at capacity, first every request runs to its end as the scheduler
        runs it, preempting (`run_to_completion`): none is abandoned. Not after a
        `ModelDivergence` (hypothesis tears down a failed run too): every later step would
        report the same divergence, under its own name."""
        if not hasattr(self, "life") or self.diverged:
            return
        self.foreign_tier_calls()
        life = self.life
        if not Stats.applied["abort_waiting"]:
            # a client gives up on a request while it waits (once a run: the scheduler's
            # steps admit waiting requests at once, so the drain below may find none)
            r = self.next_id
            self.next_id += 1
            assert self.apply("submit", r, seq(STEMS[0][:2])).rejected is None
            assert self.apply("abort_waiting", r).rejected is None
        if self.c.PREEMPT and self.at_capacity:
            self.run_to_completion()
            self.storm_once()
            self.imports_with_preemption()
        self.drain()
        if self.c.T > 1 and self.c.PREFIX and self.miss_beside_later_block():
            self.drain()
        if self.hybrid_miss_evicts_its_hit():
            self.drain()
        if self.pd:
            self.paged_transfers()
        assert all(x in ENDED and life.ends[r] == 1 for r, x in life.status.items())
        assert not any(self.s.busy) and self.quiescent() and not any(self.s.transfer)
        assert set(life.slot_state) <= {"EMPTY", "STORED"}, life.slot_state
        assert not any(self.s.lane_snap), self.s.lane_snap  # idle lanes have no snapshots
        self.forget_all()

    def hybrid_miss_evicts_its_hit(self) -> bool:
        """After the drain (every lane idle), once a run, without draws, in a configuration
        that has it (hybrid, tables of one block, B >= 2 lanes, K at most B - 1 blocks above
        the lanes' and the scratch block's; the committed core): a hybrid model's miss takes
        its own hit's entry, the only reusable block. The entries are dropped; entry E (a
        snapshot at its first chunk) and one entry per block to spare are cached; a lane
        copies from each of those (pinning it), plain requests hold the other blocks but
        one lane; then the scheduler admits a request whose prompt goes on from E: a hit
        needs a block besides E, a hybrid lane cannot take E over, so it misses into E.
        False if it did not run."""
        c, life = self.c, self.life
        spare = c.K - c.RESERVED - c.B
        if (Stats.events[HYBRID_HIT_EVICTED] or self.core is not committed or not c.HYBRID
                or c.PREEMPT or c.T != 1 or c.B < 2 or not 0 <= spare <= c.B - 1):
            return False
        for b in sorted(life.entries):
            assert self.apply("discard", b).rejected is None
        keys = [(ALPHABET[1],) * (c.C + 1)] + [(10 + i,) * (c.C + 1) for i in range(spare)]
        for key in keys:  # served into the cache, with a snapshot at the first chunk
            r, l, dst = self.next_id, self.policy.idle_lane(self.s), self.policy.reusable(self.s)
            self.next_id += 1
            assert self.apply("submit", r, seq(key)).rejected is None
            assert self.apply("admit_miss", l, r, dst).rejected is None
            while life.prefilling(l):
                assert self.apply("prefill", l, ALPHABET[0]).rejected is None
                if self.policy.snapshot(self.s, l):
                    assert self.apply("snapshot", l).rejected is None
            assert self.apply("finish", l, True).rejected is None
        held = [key + (ALPHABET[2],) for key in keys[1:]]  # hits on the others: copies
        held += [(ALPHABET[2],) * (c.C + 1)] * (c.B - 1 - spare)  # misses
        for p in held:
            r = self.next_id
            self.next_id += 1
            assert self.apply("submit", r, seq(p)).rejected is None
            self.local(r)  # the scheduler admits it (a hit's copy left in flight), no call
            self.scheduler_step(None, in_flight=True, call=False)
            assert life.status[r] == "prefill", r
        assert self.apply("submit", self.next_id, seq(keys[0] + (ALPHABET[2],))
                          ).rejected is None
        self.next_id += 1
        self.scheduler_step()
        assert Stats.events[HYBRID_HIT_EVICTED], life.owner
        return True

    def forget_all(self) -> None:
        """After the drain, without draws: a request never submitted is refused, every
        ended one is forgotten, and then the core holds no request at all (a long-running
        scheduler's state does not grow with the requests it served)."""
        if "forget" not in self.core.ACTIONS:
            return
        assert self.apply("forget", self.next_id + 3).rejected == "request_ended"
        for r in sorted(self.life.status):
            assert self.apply("forget", r).rejected is None
        assert len(self.s.phase) == 0 and len(self.s.prompt) == 0, self.s.phase

    def paged_transfers(self) -> None:
        """After the drain (every lane idle, nothing in flight), with paged tables (T > 1)
        and at capacity (with preemption too: no other table grows, and one lane's whole
        table is free), the PD situations tables of several blocks exist for, without draws
        (so that coverage does not hang on the rules' draws): a prompt of T * S - 1 tokens
        is imported into an idle lane whose table grows to cover it (before, its
        import_done is refused, and so are an export and a grow into its own block; after,
        one more grow), lands, is exported again (every block pinned) and cancelled (every
        block drains, and one transfer_end, after a misdirected one, frees them all); a
        second is cancelled mid-import, drained and freed the same way; then late events
        for it are refused by each guard that exists for them."""
        c, life = self.c, self.life
        if c.T < 2 or not self.at_capacity:
            return
        p = seq(tuple(ALPHABET[i % len(ALPHABET)] for i in range(c.T * c.S - 1)))
        for lands in (True, False):
            r = self.next_id
            self.next_id += 1
            assert self.apply("submit", r, p).rejected is None
            l, dst = life.lane.index(None), self.policy.reusable(self.s)
            assert dst is not None and self.apply("admit_import", l, r, dst).rejected is None
            self.refuse_short_import(None, l)
            assert self.apply("export", l).rejected == "lane_prefilled"
            assert self.apply("import_grow", l, dst).rejected == "dst_reusable"
            assert self.scheduler_step() and not life.needs_import_block(l)  # (it grows)
            assert self.apply("import_grow", l, dst).rejected == "table_short_of_prompt"
            if lands:
                assert self.apply("import_done", r, p, ALPHABET[0]).rejected is None
                assert self.apply("export", l).rejected is None
            assert len(life.tables[l]) > 1, life.tables[l]
            assert self.apply("fail" if lands else "abort_running", l).rejected is None
            assert self.apply("transfer_end", self.next_id + 5, dst).rejected == (
                "transfer_of_request")
            assert self.apply("transfer_end", r, dst).rejected is None
            assert not life.draining, life.draining
        for call, args, expect in (
                ("transfer_end", (r, dst), "block_draining"),
                ("import_done", (r, p, ALPHABET[0]), "request_importing"),
                ("transfer_fail", (r,), "request_transferring"),
                ("export_done", (r, False), "request_exporting")):
            assert self.apply(call, *args).rejected == expect, (call, expect)

    def drain(self) -> None:
        """teardown's serving loop, until every request has ended, without draws: what ends
        outside a step first (a drain, a store, a copy or a load: some fail; an import, a
        quarter cancelled instead, after payloads `covers_prompt` refuses; an export); the
        clients' own ends (every third waiting request abandoned, a quarter of the running
        ones aborted or failed, with pd some prefilled ones exported by their prefill
        worker, decoding ones finished, a third decoded on to their table's end, where the
        scheduler ends them); else a step of the real scheduler (`scheduler_step`: growth,
        admission, a prefill chunk or a decode call). Below capacity a lane may get no block:
        it is cancelled, and so is every lane once the steps pass a bound (with preemption
        below capacity a preempted lane could be admitted and preempted forever)."""
        life, c = self.life, self.c
        bound = 4 * (len(life.status) + 1) * (c.T * c.S + 2) * c.B
        steps = 0
        while True:
            if life.draining:
                b = min(life.draining)
                if "forget" in self.core.ACTIONS:  # its transfer's end will name it
                    assert self.apply("forget", life.draining[b]).rejected == \
                        "no_transfer_of_request"
                self.misdirected_transfer_end(b)
                self.apply("transfer_end", life.draining[b], b)
            elif life.slot_block:
                h = min(life.slot_block)
                self.apply(("store_done", "store_fail")[h % 2], h)
            elif any(life.copying):
                l = life.copying.index(True)
                load = ("load_done", "load_fail")[life.lane[l] % 2]
                self.apply("copy_done" if life.load_slot[l] is None else load, l)
            elif life.in_phase("importing"):
                r = life.in_phase("importing")[0]
                l = life.lane.index(r)
                if not life.covers_prompt(l):
                    # its KV is not asked for before the table covers the prompt (an
                    # import_done now is refused): the scheduler grows it (below capacity,
                    # or with a transfer in flight, there may be no block for it: the request
                    # is cancelled)
                    if not Stats.events[IMPORT_SHORT]:  # (once a run)
                        self.refuse_short_import(None, l)
                    steps += 1
                    if (steps > bound or not self.scheduler_step()
                            or life.lane[l] == r and life.needs_import_block(l)):
                        if life.lane[l] == r:
                            self.apply(("abort_running", "fail")[r % 2], l)
                    continue
                if r % 4 == 3:  # a quarter are cancelled mid-import: every block drains
                    self.apply(("abort_running", "fail")[r // 4 % 2], l)
                    continue
                # a payload one token short first: refused (covers_prompt), nothing changes
                short = life.prompt[r][:-1]
                assert self.apply("import_done", r, seq(short), ALPHABET[0]).rejected \
                    == "covers_prompt"
                Stats.events["prefix import rejected"] += 1
                longer = life.prompt[r] + (ALPHABET[0],)  # the first token's KV too
                assert self.apply("import_done", r, seq(longer), ALPHABET[0]).rejected \
                    == "covers_prompt"
                Stats.events["longer import rejected"] += 1
                self.apply("import_done", r, seq(life.prompt[r]), ALPHABET[0])
            elif life.in_phase("exporting"):
                self.apply("export_done", life.in_phase("exporting")[0], self.c.PREFIX)
            elif any(r is not None for r in life.lane):
                l = next(l for l in range(self.c.B) if life.lane[l] is not None)
                r = life.lane[l]
                # before the scheduler's growth, a prefill and a grow into a lane's block
                # are refused
                if life.needs_block(l):
                    if life.prefilling(l):
                        assert self.apply("prefill", l, 1).rejected == "chunk_within_block"
                    assert self.apply("grow", l, life.tail(l)).rejected == "dst_reusable"
                elif (life.computing(l) and not life.tail_full(l)
                      and not Stats.rejected["grow", "tail_full"]):
                    # room left in its tail: no next block yet (once a run, so that
                    # coverage does not hang on the rules' draws)
                    dst = self.policy.reusable(self.s)
                    assert self.apply("grow", l, 0 if dst is None else dst
                                      ).rejected == "tail_full"
                long = r % 3 == 1 or c.T > 1 and not Stats.events[
                    "decode refused at a full table"]  # (with paged tables once a run)
                steps += 1
                if r % 4 == 3 or steps > bound:  # a quarter are cancelled: aborted or failed
                    self.apply(("abort_running", "fail")[r // 4 % 2], l)
                elif self.pd and life.prefilled(l) and r % 2:
                    self.apply("export", l)  # a prefill worker's: sent (every block)
                elif life.table_end(l):  # (a drawn decode's: the scheduler ends one there)
                    self.at_table_end(l)
                    self.apply("finish", l, c.PREFIX)
                elif life.decoding(l) and not long:
                    self.client_finish(r)
                elif not self.scheduler_step():  # a long answer decodes to its table's end
                    need = [x for x in range(c.B) if life.needs_block(x)] or [l]
                    x = need[0]  # no block for it (below capacity): cancelled
                    self.apply(("abort_running", "fail")[life.lane[x] // 4 % 2], x)
            elif self.waiting():
                r = self.waiting()[0]
                # every third is abandoned; the others are admitted by the scheduler, unless
                # it declines (only below capacity)
                steps += 1
                if r % 3 == 2 or steps > bound or not self.scheduler_step():
                    self.apply("abort_waiting", r)
            else:
                break
