"""Preemption: drawn preemptions, preempt storms, the scheduler's steps with preemption
and the teardown's run to completion."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import precondition, rule

from atom_core.seq import seq
from atom_core.testing.lifecycle import (
    ALPHABET,
    IMPORT_BLOCK_PREEMPTED,
    IMPORTED_PREEMPTED_FINISHED,
    MOVING,
    STEMS,
    Stats,
)
from atom_core.testing.machine.scheduled import UNBOUNDED
from atom_core.testing.strategies import coin, num, pick, token_lists


class PreemptRules:
    """A mixin of the core state machine (`MachineBase`'s attributes and helpers)."""

    # rules: preemption ------------------------------------------------------------
    @rule(data=st.data())
    def preempt(self, data: Any) -> None:
        """preempt with a drawn lane (often a computing one, one that waits for a block,
        one whose sequence would not fit a prompt, or an idle or copying one): applied, or
        refused by the guard the lifecycle model names (without PREEMPT: preemption_on)."""
        life, c = self.life, self.c
        pred = pick(data, (life.computing, life.needs_block,
                           lambda l: life.computing(l) and len(life.seq[l]) > c.T * c.S,
                           lambda l: not life.computing(l)), "lane: computing, ...")
        self.apply("preempt", self.lanes(data, pred))

    @precondition(lambda self: self.c.PREEMPT)
    @rule(data=st.data(), k=st.integers(1, 8))
    def storm(self, data: Any, k: int) -> None:
        """A preempt storm: a request whose prompt ends on a block boundary (1..T-1 whole
        blocks, or one token short of one; often the same length for every lane) for each
        idle lane, then scheduler steps (`schedule_step`: the scheduler admits them) for
        their prefill and k more: lanes reach their block boundaries together, with few
        blocks left (K near the preemption rule's minimum), and the policy preempts to make
        room; the run's end drains them (`run_to_completion`). Often every other request is
        aborted first, and when the B lanes can share the K blocks (but the reserved
        scratch block) evenly, m < T blocks each, every prompt is m blocks long, or a token
        short of it: then the first decode call takes every lane to its boundary at once, no
        block left."""
        c, life = self.c, self.life
        if coin(data, "from idle"):  # (the client gives up on everything else)
            for l in range(c.B):
                if life.lane[l] is not None:
                    assert self.apply("abort_running", l).rejected is None
            for r in self.waiting():
                assert self.apply("abort_waiting", r).rejected is None
        n = num(data, 1, c.T - 1, "blocks") * c.S - num(data, 0, 1, "short (1)")
        same = coin(data, "the same length")
        m, rest = divmod(c.K - c.RESERVED, c.B)
        if (same and not rest and 1 <= m < c.T and c.B > 1
                and all(r is None for r in life.lane)):
            n = m * c.S - num(data, 0, 1, "short (1)")
        for _ in range(self.s.busy.count(False)):
            if not same:
                n = num(data, 1, c.T - 1, "blocks") * c.S - num(data, 0, 1, "short (1)")
            p = seq(data.draw(token_lists(n, n), label="prompt"))
            assert self.apply("submit", self.next_id, p).rejected is None
            self.next_id += 1
        # (the scheduler admits them in its first step, as many as have room; then each
        # prompt's prefill, a chunk a step, then k more steps)
        for _ in range(c.B * (n // c.C) + k):
            if not self.schedule_step(data):
                return

    def schedule_step(self, data: Any = None) -> bool:
        """One serving step with preemption: what ends outside a step first (copies, loads and
        stores other rules left in flight land; with PD, a drain ends, then a transfer: an
        import whose table covers its prompt lands, an export ends); else, a lane at its
        table end (only a drawn decode leaves one: the scheduler ends a request there) is
        refused a preemption, a grow and a decode call (`at_table_end`) and finishes; then
        the real scheduler's step (`scheduler_step`: growth, preempting when no block is
        reusable, admission, one prefill chunk or a decode call, preempting for a padding
        target). False if there is nothing to do."""
        life, c = self.life, self.c
        if any(life.copying):  # a device copy, or a load from the host tier
            l = life.copying.index(True)
            self.apply("copy_done" if life.load_slot[l] is None else "load_done", l)
            return True
        for h in life.slots("STORING"):  # a spill's store lands (the adapter's: at once)
            self.apply("store_done", h)
            return True
        if life.draining:  # a cancelled transfer ends: every block draining for it frees
            b = min(life.draining)
            self.apply("transfer_end", life.draining[b], b)
            return True
        moving = [l for l in range(c.B) if life.transfer_in_flight(l)]
        if moving:  # (an import short of its prompt grows first: its KV is not asked for)
            l = moving[0]
            r = life.lane[l]
            if life.importing(l):
                self.apply("import_done", r, seq(life.prompt[r]), ALPHABET[l % len(ALPHABET)])
            else:
                self.apply("export_done", r, c.PREFIX and r % 4 < 2)
            return True
        if not self.waiting() and all(r is None for r in life.lane):
            return False
        for l in range(c.B):
            if life.table_end(l):
                self.at_table_end(l)
                self.apply("finish", l, c.PREFIX and life.lane[l] % 4 < 2)
        return self.scheduler_step(data)

    def at_table_end(self, l: int) -> None:
        """Decoding lane l's table is full (T blocks, the last one full), before it finishes:
        while another lane waits for a block and none is reusable, its preemption is refused
        (its sequence would not fit a prompt: `requeue_fits`); a decode call is refused
        (`no_block_overflow`), and a grow (`table_not_full`, once a run: teardown's drain may
        never see one). Refused calls: nothing changes (the scheduler calls this before it
        finishes such a lane)."""
        life, c = self.life, self.c
        s, toks = self.s, (ALPHABET[0],) * c.B
        out = self.apply("decode", self.policy.pad(s), self.policy.local_pad(s), toks)
        assert out.rejected == "no_block_overflow", out.rejected
        if c.PREEMPT and life.waits_for_block() and not any(map(life.reusable, range(c.K))):
            assert self.apply("preempt", l).rejected == "requeue_fits"
        if not Stats.rejected["grow", "table_not_full"]:
            assert self.apply("grow", l, 0).rejected == "table_not_full"

    def run_to_completion(self) -> None:
        """With preemption, at capacity: the scheduler (`schedule_step`) runs every waiting
        and running request to its end: each one finishes (preempted ones too, admitted
        again; with PD, imports land and exports end), none is abandoned, and it does not
        hang (a bound on the steps: the oldest lane always advances)."""
        life, c = self.life, self.c
        todo = life.in_phase("waiting", "prefill", "decode", *MOVING)
        bound = 4 * (len(todo) + 1) * (c.T * c.S + 2) * c.B
        for _ in range(bound):
            if not self.schedule_step():
                break
        else:
            raise AssertionError(f"the scheduler did not drain {todo} in {bound} steps: "
                                 f"{self.core.describe_state(self.s)}")
        assert all(life.status[r] == "finished" for r in todo), {
            r: life.status[r] for r in todo}
        if any(r in life.preempted for r in todo):
            Stats.events["preempted requests drained"] += 1

    def storm_once(self) -> None:
        """After `run_to_completion` (every lane idle): a preempt storm as `storm` makes
        one, without draws, once a run, when the configuration has room for one (B >= 2
        lanes share the K blocks but the reserved scratch block evenly, m < T blocks each):
        the cache entries are dropped (no hit puts a lane ahead of the others), B prompts one
        token short of m blocks are admitted at once and the scheduler runs them to their end
        (`run_to_completion`): prefill (a lane's chunks after another's) leaves every lane a
        token short of its last boundary, and the first decode call takes them all there at
        once, no block left. (So that coverage does not hang on `storm`'s draws.)"""
        life, c = self.life, self.c
        m, rest = divmod(c.K - c.RESERVED, c.B)
        if (Stats.events["preempt storm: every lane at a block boundary"] or c.B < 2 or rest
                or not 1 <= m < c.T or "discard" not in self.core.ACTIONS):
            return
        for b in sorted(life.entries):
            assert self.apply("discard", b).rejected is None
        for l in range(c.B):  # (the scheduler admits them: each that has room)
            p = seq((ALPHABET[l % len(ALPHABET)],) * (m * c.S - 1))
            assert self.apply("submit", self.next_id, p).rejected is None
            self.scheduler().limit[self.next_id] = UNBOUNDED  # (none ends before the storm)
            self.next_id += 1
        self.run_to_completion()

    def imports_with_preemption(self) -> None:
        """After `run_to_completion` (every lane idle), with PD: the situations PD with
        preemption exists for, without draws, once a run each, when the configuration has
        them (B >= 2 lanes, fewer reusable blocks than B whole tables), each run to its end
        by the scheduler (`run_to_completion`). (So that coverage does not hang on the
        flows' draws.) The cache entries are dropped first (no hit).
        1. A prompt of T * S - 1 tokens is imported; while its table is short a second
        import is refused (`one_import_table_growing`); local requests then hold every
        block left (up to B - 1 whole tables), so its table grows by preempting them
        (the scheduler's growth: the oldest lane), and it lands.
        2. A local request whose prompt ends on a block boundary, local ones holding the
        blocks but the import's, then an import into those: it lands, and when the older
        lane grows the import is the victim (the most recently admitted lane); it waits
        again, is recomputed here and finishes."""
        life, c = self.life, self.c
        room = c.K - c.RESERVED  # (every block but the reserved scratch one is reusable)
        if not self.pd or c.B < 2 or room >= c.B * c.T or "discard" not in self.core.ACTIONS:
            return
        if not Stats.events[IMPORT_BLOCK_PREEMPTED]:
            self.drop_entries()
            l = self.import_prompt(c.T * c.S - 1)
            r = self.next_id
            self.next_id += 1
            assert self.apply("submit", r, seq(STEMS[0][:1])).rejected is None
            out = self.apply("admit_import", life.lane.index(None), r, 0)
            assert out.rejected == "one_import_table_growing", out.rejected
            assert self.apply("abort_waiting", r).rejected is None
            held = min(room - 1, (c.B - 1) * c.T)
            self.hold_blocks([min(c.T, held - i) for i in range(0, held, c.T)])
            while life.needs_import_block(l):  # (the oldest lane: it grows first)
                assert self.scheduler_step(), "the import's table does not grow"
            assert Stats.events[IMPORT_BLOCK_PREEMPTED]
            self.land(l)
            self.run_to_completion()
        if not Stats.events[IMPORTED_PREEMPTED_FINISHED]:
            self.drop_entries()
            k = min(c.T - 1, room - 1)  # the older lane's blocks (it needs its next one)
            q = min(c.T, room - k)  # the import's
            rest = room - k - q  # (in at most B - 2 lanes: room < B * T)
            self.hold_blocks([k], boundary=True)
            self.hold_blocks([min(c.T, rest - i) for i in range(0, rest, c.T)])
            l = self.import_prompt(q * c.S - 1)
            r = life.lane[l]
            while life.needs_import_block(l):  # into the blocks left (the older lane waits)
                dst = self.policy.reusable(self.s)
                assert dst is not None and self.apply("import_grow", l, dst).rejected is None
            self.land(l)
            self.scheduler_step()  # the older lane grows: the import is its victim
            assert r in life.preempted_imports, (r, life.lane)
            self.run_to_completion()
            assert Stats.events[IMPORTED_PREEMPTED_FINISHED]

    def drop_entries(self) -> None:
        """Every lane idle: the cache entries are discarded (no admission or growth hits)."""
        for b in sorted(self.life.entries):
            assert self.apply("discard", b).rejected is None

    def import_prompt(self, n: int) -> int:
        """A prompt of n tokens is imported into an idle lane (the policy's lane and
        block); its lane."""
        r, l = self.next_id, self.policy.idle_lane(self.s)
        self.next_id += 1
        p = seq(tuple(ALPHABET[i % len(ALPHABET)] for i in range(n)))
        assert self.apply("submit", r, p).rejected is None
        dst = self.policy.reusable(self.s)
        assert l is not None and dst is not None
        assert self.apply("admit_import", l, r, dst).rejected is None
        return l

    def land(self, l: int) -> None:
        """Importing lane l's table covers its prompt: its import lands."""
        r = self.life.lane[l]
        out = self.apply("import_done", r, seq(self.life.prompt[r]), ALPHABET[0])
        assert out.rejected is None, out.rejected

    def hold_blocks(self, sizes: list[int], boundary: bool = False) -> None:
        """For each size j: a local request of j blocks' worth of tokens (one token short
        of their end; `boundary`: up to it, so it needs its next block) is admitted into
        an idle lane (a miss: no entry) and prefilled, its table grown by `grow` into the
        policy's blocks (not a scheduler step: an older importing lane would take them)."""
        life, c = self.life, self.c
        for j in sizes:
            r, l = self.next_id, self.policy.idle_lane(self.s)
            self.next_id += 1
            p = seq((ALPHABET[r % len(ALPHABET)],) * (j * c.S - (not boundary)))
            assert self.apply("submit", r, p).rejected is None
            dst = self.policy.reusable(self.s)
            assert l is not None and dst is not None
            assert self.apply("admit_miss", l, r, dst).rejected is None
            while life.prefilling(l):
                if life.tail_full(l):
                    dst = self.policy.reusable(self.s)
                    assert dst is not None and self.apply("grow", l, dst).rejected is None
                assert self.apply("prefill", l, ALPHABET[0]).rejected is None
