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
        idle lane, admitted as the policy chooses, then scheduler steps (`schedule_step`)
        for their prefill and k more: lanes reach their block boundaries together, with few
        blocks left (K near the preemption rule's minimum), and the policy preempts to make
        room;
        the run's end drains them (`run_to_completion`). Often every other request is
        aborted first, and when the B lanes can share the K blocks (but the reserved
        scratch block) evenly, m < T blocks each, every prompt is m blocks long: every lane
        reaches its boundary at once, no block left."""
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
            n = m * c.S
        for _ in range(self.s.busy.count(False)):
            if not same:
                n = num(data, 1, c.T - 1, "blocks") * c.S - num(data, 0, 1, "short (1)")
            p = seq(data.draw(token_lists(n, n), label="prompt"))
            assert self.apply("submit", self.next_id, p).rejected is None
            self.next_id += 1
            if not self.admit_by_policy(self.next_id - 1):
                break
        for _ in range(n // c.C + k):  # (the prompts' prefill, then k more steps)
            if not self.schedule_step(data):
                return

    def schedule_step(self, data: Any = None) -> bool:
        """One scheduler step with preemption, as the adapter takes it: copies, loads and
        stores land; with PD, a drain ends, then a transfer (an import whose table covers
        its prompt lands, an export ends); the lanes that need a block grow (the oldest
        first, importing lanes too; preempting when there is none);
        the oldest waiting request is admitted if the policy finds room; lanes grow again;
        each prefilling lane prefills a chunk; lanes at their table end finish (with data,
        sometimes lanes after a few tokens); then a decode call (preempting for a padding
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
        self.grow_by_policy(data)
        if self.waiting() and None in life.lane:
            self.admit_by_policy(self.waiting()[0])
            if any(life.copying):
                return True
        self.grow_by_policy(data)
        for l in range(c.B):
            if life.prefilling(l) and not life.copying[l] and not life.needs_block(l):
                self.apply("prefill", l, ALPHABET[l % len(ALPHABET)])
        for l in range(c.B):  # a lane finishes at its table end, or (odd requests) a
            r = life.lane[l]  # block's worth of tokens past its prompt
            if (life.table_end(l) and life.waits_for_block()
                    and not any(map(life.reusable, range(c.K)))):
                # its sequence would not fit a prompt: not a victim (it finishes instead)
                assert self.apply("preempt", l).rejected == "requeue_fits"
            if life.table_end(l) and not Stats.rejected["grow", "table_not_full"]:
                # no next block there (once a run: teardown's drain may never see one)
                assert self.apply("grow", l, 0).rejected == "table_not_full"
            if life.table_end(l) or (life.decoding(l) and r % 2 and life.length[l] >= len(
                    life.prompt[r]) + c.S):
                self.apply("finish", l, c.PREFIX and r % 4 < 2)
        self.grow_by_policy(data)
        if any(map(life.decoding, range(c.B))):
            toks = (tuple(data.draw(token_lists(c.B, c.B), label="tokens"))
                    if data is not None else (ALPHABET[0],) * c.B)
            self.decode_by_policy(toks, data)
        return True

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
        the cache entries are dropped (no hit puts a lane ahead of the others), B prompts of
        m blocks are admitted at once and the scheduler runs them to their end
        (`run_to_completion`): at their last boundary every lane waits for a block. (So that
        coverage does not hang on `storm`'s draws.)"""
        life, c = self.life, self.c
        m, rest = divmod(c.K - c.RESERVED, c.B)
        if (Stats.events["preempt storm: every lane at a block boundary"] or c.B < 2 or rest
                or not 1 <= m < c.T or "discard" not in self.core.ACTIONS):
            return
        for b in sorted(life.entries):
            assert self.apply("discard", b).rejected is None
        for l in range(c.B):
            p = seq((ALPHABET[l % len(ALPHABET)],) * (m * c.S))
            assert self.apply("submit", self.next_id, p).rejected is None
            self.next_id += 1
            if not self.admit_by_policy(self.next_id - 1):
                break  # (dynamic scratch: room for a padding block too)
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
        (`import_grow_by_policy`), and it lands.
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
            assert self.import_grow_by_policy(None, l)
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
            assert self.import_grow_by_policy(None, l)  # (the blocks left: no preemption)
            self.land(l)
            assert self.grow_by_policy() and life.lane[l] is None, (l, life.lane)
            assert r in life.preempted_imports, r
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
        policy's blocks (not `grow_by_policy`: an older importing lane would take them)."""
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
