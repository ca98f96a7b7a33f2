"""Refinement and refused calls around the policy's choices: the checks the scheduler's
steps (scheduled.py) and the machine's flows share (a choice the spec accepts, the longest
hits it accepts, the calls a full tail, a short import or a preemption must be refused), and
a drawn entry spilled into the slot the policy picks. The choices themselves are the real
`Scheduler`'s (scheduled.py): no loop, spill rule or victim choice is restated here."""

from __future__ import annotations

from typing import Any

from atom_core.seq import seq
from atom_core.testing.lifecycle import (
    ALPHABET,
    IMPORT_SHORT,
    Stats,
)
from atom_core.testing.machine.errors import (
    RefinementViolation,
)
from atom_core.testing.strategies import (
    num,
    pick,
    tokens,
)


class PolicySteps:
    """A mixin of the core state machine (`MachineBase`'s attributes and helpers)."""

    def spill_entry(self, data: Any, b: int) -> bool:
        """Store cache entry b (the machine's pick) into the slot the policy picks for it
        (`Policy.spill_slot`, evicting the least recently used host entry when every slot is
        full); the store then lands, fails or stays in flight (without data: it lands).
        False if the policy keeps no copy of b."""
        place = self.policy.spill_slot(self.s, b)
        if place is None:
            return False
        h, evict = place
        # Refinement: the policy's slot (after its eviction) takes b.
        if evict:
            self.refine("host_evict", {"h": h})
            assert self.apply("host_evict", h).rejected is None
        self.refine("spill", {"b": b, "h": h})
        assert self.apply("spill", b, h).rejected is None
        how = "done" if data is None else pick(data, ("done", "fail", "in flight"), "store")
        if how == "in flight":
            self.busy_store(data, h)
        else:
            assert self.apply(f"store_{how}", h).rejected is None
        Stats.events["policy spill"] += 1
        return True

    def complete_copy(self, data: Any, l: int) -> Any:
        """The copy into lane l lands (copy_done), or its load lands or fails."""
        if self.life.load_slot[l] is None:
            return self.apply("copy_done", l)
        return self.apply("load_fail" if num(data, 0, 2, "load fails (0)") == 0
                          else "load_done", l)

    def refine(self, action: str, args: dict[str, Any]) -> None:
        """The policy's choice is a step the spec allows."""
        why = self.core.ACTIONS[action][1](self.s, **args)
        if why is not None:
            raise RefinementViolation(action, f"chose {args}, refused by {why}", self.core,
                                      self.s)

    def refuse_preempt(self, data: Any) -> None:
        """Before the policy's preemption: preempting an idle or copying lane, or one whose
        sequence would not fit a prompt, must be refused (without data: the first lane
        whose sequence would not fit, if any)."""
        life, c = self.life, self.c
        calls = [(l, "requeue_fits") for l in range(c.B)
                 if life.computing(l) and len(life.seq[l]) > c.T * c.S]
        if data is None:
            if calls:
                assert self.apply("preempt", calls[0][0]).rejected == "requeue_fits"
            return
        calls += [(l, "lane_computing") for l in range(c.B) if not life.computing(l)]
        if calls:
            l, expect = pick(data, calls, "refused preempt")
            assert self.apply("preempt", l).rejected == expect, (l, expect)

    def import_may_wait(self, l: int) -> bool:
        """With preemption, importing lane l may wait for its next block though no block is
        reusable and no lane can be preempted (`import_table_grows`): another lane's
        transfer is in flight (its blocks free, or it decodes and can be preempted, when it
        ends), or a lane at its table's end must finish first (its blocks free then)."""
        life = self.life
        return self.c.PREEMPT and any(
            x != l and (life.transfer_in_flight(x) or life.table_end(x))
            for x in range(self.c.B))

    def refuse_short_import(self, data: Any, l: int) -> None:
        """Importing lane l's table does not cover its prompt: its import_done (even with
        the whole prompt) is refused, and (with data) a grow into a block it may not take
        (a lane's, its own included, the scratch block, a pinned, draining or spilling
        one)."""
        life, c = self.life, self.c
        r = life.lane[l]
        tok = ALPHABET[0] if data is None else data.draw(tokens, label="first token")
        out = self.apply("import_done", r, seq(life.prompt[r]), tok)
        assert out.rejected == "table_covers_prompt", out.rejected
        Stats.events[IMPORT_SHORT] += 1
        if data is not None:
            bad = [b for b in range(c.K) if not life.reusable(b)]  # (its own blocks)
            dst = pick(data, bad, "dst")
            assert self.apply("import_grow", l, dst).rejected == "dst_reusable", dst

    def longest_host_hits(self, l: int) -> list[tuple[int, int]]:
        """The (slot, n) of the longest host hits past the first block the spec accepts for
        lane l (any dst: with lane l's own tail, never reusable, `grow_host_hit`'s guard
        reports dst_reusable, its last, exactly when every guard before it holds)."""
        c = self.c
        ok = [(h, n) for h in range(c.H) for n in range(c.C, c.S + 1, c.C)
              if self.core.grow_host_hit_guard(self.s, l, h, self.s.tail[l], n) == "dst_reusable"]
        top = max((n for _, n in ok), default=0)
        return [(h, n) for h, n in ok if n == top]

    def longest_hits(self, l: int) -> list[tuple[int, int]]:
        """The (src, n) of the longest hits past the first block the spec accepts for lane
        l (any dst: `grow_hit`'s guard reports dst_not_src, its second to last, for
        dst == src exactly when every guard before it holds, hybrid_snapshot_at_n too)."""
        c = self.c
        ok = [(src, n) for src in range(c.K) for n in range(c.C, c.S + 1, c.C)
              if self.core.grow_hit_guard(self.s, l, src, src, n) == "dst_not_src"]
        top = max((n for _, n in ok), default=0)
        return [(src, n) for src, n in ok if n == top]

    def refuse_full_tail(self, data: Any, l: int) -> None:
        """Lane l's tail is full: before it grows, its next prefill chunk (or any decode
        call), a grow into a block it may not take (a lane's, the scratch block, a pinned,
        draining or spilling one) or, at the table end, any grow must be refused."""
        life, c = self.life, self.c
        bad = [b for b in range(c.K) if not life.reusable(b)]
        calls = []
        if len(life.tables[l]) == c.T:
            dst = self.policy.reusable(self.s)
            calls.append(("grow", (l, 0 if dst is None else dst), "table_not_full"))
        elif bad:
            calls.append(("grow", (l, pick(data, bad, "dst")), "dst_reusable"))
        if life.prefilling(l):
            calls.append(("prefill", (l, 1), "chunk_within_block"))
        else:
            calls.append(("decode", (0, 0, self.decode_tokens(data)), "no_block_overflow"))
        call, args, expect = pick(data, calls, "refused")
        assert self.apply(call, *args).rejected == expect, (call, args, expect)

    def refuse_later_hit(self, data: Any, r: int) -> None:
        """Waiting r's prefix matches a cache entry that starts later in its sequence: a
        hit on it is refused (src_first_block). Without data, the first such entry."""
        c = self.c
        later = [(src, n) for x, src, n in self.hits_on_later_blocks() if x == r]
        idle = [l for l in range(c.B) if not self.s.busy[l]]
        if later and idle:
            src, n = later[0] if data is None else pick(data, later, "entry, n")
            dst = self.policy.reusable(self.s, exclude=src)
            args = (idle[0], r, src, (src + 1) % c.K if dst is None else dst, n)
            assert self.apply("admit_hit", *args).rejected == "src_first_block"
