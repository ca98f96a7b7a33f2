"""Prefill/decode disaggregation: imports, exports, transfers that fail or are cancelled,
and late or misdirected PD events."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis.stateful import precondition, rule

from atom_core.seq import seq
from atom_core.testing.lifecycle import ALPHABET, ENDED, IMPORT_SHORT, MOVING, Stats
from atom_core.testing.strategies import coin, num, pick, tokens


class PDRules:
    """A mixin of the core state machine (`MachineBase`'s attributes and helpers)."""

    # rules: prefill/decode disaggregation -----------------------------------------
    @precondition(lambda self: self.waiting())
    @rule(data=st.data())
    def admit_import(self, data: Any) -> None:
        """Decode side: a waiting request takes an idle lane and a block the policy would
        reuse, its table's first, to receive its KV by transfer (accepted; with PREEMPT,
        refused while another importing table grows: `one_import_table_growing`); or drawn
        parameters (rejected unless legal)."""
        s, c = self.s, self.c
        idle = [l for l in range(c.B) if not s.busy[l]]
        dst = self.policy.reusable(s)
        if idle and dst is not None and num(data, 0, 3, "drawn (0)"):
            r = pick(data, self.waiting(), "request")
            expect = "one_import_table_growing" if self.life.import_table_grows() else None
            out = self.apply("admit_import", pick(data, idle), r, dst)
            assert out.rejected == expect, out.rejected
            return
        l = self.lanes(data, lambda l: not self.s.busy[l])
        w = self.waiting()
        r = pick(data, w, "request") if coin(data, "waiting") else self.any_request(data)
        self.apply("admit_import", l, r, self.block(data, "dst"))

    @rule(data=st.data(), k=st.integers(1, 8))
    def pd_flow(self, data: Any, k: int) -> None:
        """Up to k PD steps (`pd_step`), submitting and prefilling to get there."""
        for _ in range(k):
            if not self.pd_step(data, feed=True):
                return

    def pd_step(self, data: Any, feed: bool) -> bool:
        """One PD step, whichever the draw picks among the possible ones: import a waiting
        request (the policy's lane and block; with PREEMPT, refused while another importing
        table grows), grow an importing lane's table toward its prompt's end (a scheduler
        step: its growth takes `import_grow` before it asks for the KV; with PREEMPT,
        preempting computing lanes for its blocks), export a prefilled lane (every block of
        its table), deliver an import (the whole prompt, or a payload `covers_prompt`
        rejects; refused while the table is short), end an export, fail a transfer, cancel
        one (abort or failure of its lane: every block drains) or end a drain (every block
        draining for the request). feed: also submit, complete a copy or take a scheduler
        step (it grows, admits, prefills or decodes). False if none is possible."""
        life, c, s = self.life, self.c, self.s
        prefilled = [l for l in range(c.B) if life.prefilled(l)]
        prefilling = [l for l, r in enumerate(life.lane)
                      if r is not None and life.status[r] == "prefill"]
        importing, exporting = life.in_phase("importing"), life.in_phase("exporting")
        moving = importing + exporting
        short = [l for l in range(c.B) if life.needs_import_block(l)]
        moves = ["import"] if self.waiting() and not all(s.busy) else []
        moves += ["import_grow"] * 2 if short else []
        moves += ["export"] * 2 if prefilled else []
        # An export of a lane that has decoded past its prompt is refused.
        decoded = [l for l in range(c.B) if life.decoding(l) and not life.prefilled(l)]
        moves += ["late_export"] if decoded else []
        moves += ["import_done"] * 2 if importing else []
        moves += ["export_done"] * 2 if exporting else []
        moves += ["transfer_fail", "cancel"] if moving else []
        moves += ["transfer_end", "late"] if life.draining else []
        if feed:
            moves += ["submit"] if not self.waiting() else []
            moves += ["step"] if prefilling or self.waiting() and None in life.lane else []
        if not moves:
            return False
        move = pick(data, moves, "pd move")
        if move == "import":
            dst = self.policy.reusable(s)
            if dst is None:  # refinement: only while a copy runs or a block drains
                assert not (self.quiescent() and self.at_capacity
                            and self.admission_room()), "no block to import to"
                return False
            # often a prompt past one block (its table grows before the import lands)
            w = self.waiting()
            long = [r for r in w if len(life.prompt[r]) > c.S]
            l = self.policy.idle_lane(s)
            r = pick(data, long if long and coin(data, "past one block") else w, "request")
            if life.import_table_grows():  # one importing table grows at a time
                assert self.apply("admit_import", l, r, dst).rejected == (
                    "one_import_table_growing")
                return True
            if life.draining and coin(data, "a draining block first"):  # refused
                b = pick(data, sorted(life.draining), "draining")
                assert self.apply("admit_import", l, r, b).rejected == "dst_reusable"
            assert self.apply("admit_import", l, r, dst).rejected is None
            if life.needs_import_block(l) and coin(data, "grow now"):  # (else a later step)
                return self.scheduler_step(data)
        elif move == "import_grow":  # often a refused call first, and one more after
            l = pick(data, short, "lane")
            if coin(data, "refused first"):
                self.refuse_short_import(data, l)
            if not self.scheduler_step(data) or life.needs_import_block(l):
                return False  # (no block for it yet: a copy or a drain runs)
            if num(data, 0, 2, "once more (0)") == 0 and life.importing(l):
                # its table covers the prompt now
                dst = self.policy.reusable(self.s)
                assert self.apply("import_grow", l, 0 if dst is None else dst).rejected \
                    == "table_short_of_prompt"
        elif move == "export":
            assert self.apply("export", pick(data, prefilled, "lane")).rejected is None
        elif move == "late_export":
            l = pick(data, decoded, "lane")
            assert self.apply("export", l).rejected == "lane_prefilled"
        elif move == "import_done":
            self.deliver(data, pick(data, importing, "request"))
        elif move == "export_done":  # keep without the prefix cache is rejected
            r, keep = pick(data, exporting, "request"), coin(data, "keep")
            out = self.apply("export_done", r, keep)
            assert (out.rejected is None) == (c.PREFIX or not keep), out.rejected
        elif move == "transfer_fail":
            r = pick(data, moving, "request")
            table = list(life.tables[life.lane.index(r)])
            assert self.apply("transfer_fail", r).rejected is None
            assert all(self.s.owner[b] == self.core.OWNER_FREE and not self.s.transfer[b]
                       for b in table), table
        elif move == "cancel":
            l = life.lane.index(pick(data, moving, "request"))
            kind, table = pick(data, ("abort_running", "fail"), "how"), list(life.tables[l])
            assert self.apply(kind, l).rejected is None
            assert all(self.s.owner[b] == self.core.OWNER_DRAINING and self.s.transfer[b]
                       for b in table), table
            Stats.events[f"{kind} drains"] += 1
        elif move == "transfer_end":
            b = pick(data, sorted(life.draining), "block")
            r = life.draining[b]
            ended = [x for x, q in life.draining.items() if q == r]
            self.misdirected_transfer_end(b)
            assert self.apply("transfer_end", r, b).rejected is None
            assert all(self.s.owner[x] == self.core.OWNER_FREE and not self.s.transfer[x]
                       for x in ended), ended
            Stats.events["drain released"] += 1
        elif move == "late":  # e.g. a duplicate of the event that just ended a drain
            self.late_event(data)
        elif move == "submit":
            self.new_request(data, short=num(data, 0, 3, "any length (0)") == 0)
        elif any(self.s.copying[l] for l in prefilling):
            self.complete_copy(data, next(l for l in prefilling if self.s.copying[l]))
        elif not self.scheduler_step(data):
            return False
        return True

    def misdirected_transfer_end(self, b: int) -> None:
        """Before block b's drain ends: its transfer_end named with a request that never
        was, refused (transfer_of_request). Once a run (`late_event` draws such events; so
        that coverage does not hang on its draws: drains are rare)."""
        if not Stats.rejected["transfer_end", "transfer_of_request"]:
            assert self.apply("transfer_end", self.next_id + 5, b).rejected == (
                "transfer_of_request")
            Stats.events["misdirected transfer_end rejected"] += 1

    def deliver(self, data: Any, r: int) -> None:
        """r's import ends: the whole prompt (accepted), or a partial, mismatched or
        over-long payload, which `covers_prompt` rejects, changing nothing (the adapter
        then fails the request: transfer_fail). While r's table does not cover its prompt
        every payload is refused (`table_covers_prompt`: the adapter has not asked for
        the KV yet)."""
        p, tok = self.life.prompt[r], data.draw(tokens, label="first token")
        kind = pick(data, ("whole", "whole", "prefix", "mismatch", "longer"), "payload")
        if kind == "prefix":
            payload = p[:num(data, 0, len(p) - 1, "prefix length")]
        elif kind == "mismatch":
            i = num(data, 0, len(p) - 1, "position")
            payload = p[:i] + ((p[i] % len(ALPHABET)) + 1,) + p[i + 1:]
        elif kind == "longer":  # the first token too, as if it had KV
            payload = p + (tok,)
        else:
            payload = p
        out = self.apply("import_done", r, seq(payload), tok)
        if not self.life.covers_prompt(self.life.lane.index(r)):
            # the table is short of the prompt: no transfer runs yet (any payload is
            # refused before it is looked at)
            assert out.rejected == "table_covers_prompt", (kind, payload, out.rejected)
            Stats.events[IMPORT_SHORT] += 1
        elif kind != "whole":
            assert out.rejected == "covers_prompt", (kind, payload, out.rejected)
            Stats.events[f"{kind} import rejected"] += 1
            if coin(data, "then fail it"):
                self.apply("transfer_fail", r)

    @rule(data=st.data())
    def late_pd_event(self, data: Any) -> None:
        """A late, duplicate or misdirected transfer event (for a request that is unknown,
        ended or not transferring, or a block that is not draining for it): the core
        must refuse it and change nothing."""
        self.late_event(data)

    def late_event(self, data: Any) -> None:
        """See late_pd_event (pd_step takes one too, right where drains come and go)."""
        life = self.life
        ended = life.in_phase(*ENDED)
        other = life.in_phase("waiting", "prefill", "decode")
        drained = [x for x in life.drained
                   if life.draining.get(x[1], x[0]) != x[0]]  # its block drains again
        options = ["unknown", "wrong_block"]
        options += ["ended"] * 3 if ended else []
        options += ["other"] if other else []
        options += ["drained"] * 2 if life.drained else []
        options += ["redrained"] * 2 if drained else []
        options += ["other_drain"] * 2 if life.draining else []
        kind = pick(data, options, "kind")
        if kind in ("drained", "redrained"):  # a duplicate transfer_end
            r, b = pick(data, drained if kind == "redrained" else life.drained)
            expect = "transfer_of_request" if b in life.draining else "block_draining"
            assert self.apply("transfer_end", r, b).rejected == expect
            Stats.events[f"{kind} transfer_end rejected"] += 1
            return
        if kind == "wrong_block":  # a block not draining, named with its (last) transfer's
            # request: one still transferring, or whose transfer ended normally
            s = self.s
            b = pick(data, [b for b in range(self.c.K) if b not in life.draining] or [0])
            r = s.transfer_req[b] if s.transfer_req[b] is not None else self.next_id
            if b not in life.draining:
                assert self.apply("transfer_end", r, b).rejected == "block_draining"
            return
        if kind == "other_drain":  # a draining block, named with another request
            b = pick(data, sorted(life.draining), "block")
            r = pick(data, [x for x in (*life.draining.values(), *life.in_phase(*MOVING),
                                        *life.status, self.next_id + 5)
                            if x != life.draining[b]], "request")
            assert self.apply("transfer_end", r, b).rejected == "transfer_of_request"
            Stats.events["misdirected transfer_end rejected"] += 1
            return
        if kind == "unknown":
            r = self.next_id + 5
        else:
            r = pick(data, ended if kind == "ended" else other, "request")
        p = seq(life.prompt.get(r, (1,)))  # what r's import would have had to deliver
        call, args, expect = pick(data, (
            ("import_done", (r, p, 1), "request_importing"),
            ("transfer_fail", (r,), "request_transferring"),
            ("export_done", (r, False), "request_exporting")), "event")
        out = self.apply(call, *args)
        assert out.rejected == expect, (kind, call, args, out.rejected)
        Stats.events[f"late {call} rejected"] += 1
