"""The machine's base: setup, the checks of every step (`apply`: invariants, transition
invariants, the lifecycle model, the ghost-off mirror, progress) and the natural workload
(`submit`, `admit`, `advance`). The other rules and helpers are mixins beside it
(`atom_core.testing.machine`): single actions and the calls that must be rejected
(actions.py), refinement and refused calls around the policy's choices (policy_steps.py),
the real scheduler's steps (scheduled.py), teardown (teardown.py) and one per feature tier."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import hypothesis.strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from atom_core._generated import core as committed
from atom_core.policy import POLICIES
from atom_core.seq import seq
from atom_core.testing.lifecycle import (
    ALPHABET,
    CRASH,
    MOVING,
    Life,
    Stats,
)
from atom_core.testing.machine.errors import (
    InvariantViolation,
    LifecycleDivergence,
    MirrorDivergence,
    ModelDivergence,
    ProgressViolation,
)
from atom_core.testing.strategies import (
    Capacity,
    coin,
    num,
    pick,
    prompts,
    token_lists,
)

# The rules that take PD actions (make_machine(pd=False) drops them).
PD_RULES = {"admit_import", "pd_flow", "late_pd_event"}
# The rules that preempt with drawn parameters or storm (make_machine(preempt=False) drops
# them: a machine without them draws its steps as before they existed).
PREEMPT_MACHINE_RULES = {"preempt", "storm"}


def to_committed(e: Any) -> Any:
    """An effect of a loaded variant core as the committed core's class (Policy.observe
    dispatches on the committed classes)."""
    cls = committed.EFFECTS.get(type(e).__name__.lower())
    return cls(*e) if cls is not None and cls._fields == e._fields else e


class MachineBase(RuleBasedStateMachine):
    """The rules and checks every configuration takes. `make_machine` sets the class
    attributes below and makes `setup` the initialize rule."""

    core: Any
    mcore: Any
    plain_fields: list[str]
    convert: Callable[[Any], Any]
    mirroring: bool
    check_progress: bool
    pd: bool
    capacity: Capacity

    def setup(self, c: Any, policy: str = "lru", scene: bool = False) -> None:
        """The machine over configuration c, with the registered policy `policy`
        (`atom_core.policy.POLICIES`: every registered one is drawn); scene: the example
        starts with `adopt_scene` (paged.py), where the configuration allows it."""
        self.c = c
        self.s = self.core.init(c, True)
        self.s2 = (self.mcore.init(self.mcore.Consts(**attrs.asdict(c)), False)
                   if self.mirroring else None)
        self.policy = POLICIES[policy]()
        self.life = Life(c)
        self.diverged = False  # the core's state differs from the lifecycle model's
        self.next_id = 0
        scratch = "reserved" if c.RESERVED else "dynamic"
        self.at_capacity = c.K >= self.capacity(c.B, c.PREFIX, scratch, c.T, c.PREEMPT)
        # once an example: a drawn grow_adopt in a turn (paged.py), a busy load cancelled
        # (host.py); per example, not per run, so that hypothesis replays an example exactly
        self.adopted = self.load_cancelled = False
        assert self.core.check_axioms(c) == []
        assert self.core.check_invariants(self.s) == []
        if scene:
            self.adopt_scene()  # type: ignore[attr-defined]  # (PagedRules, in CoreMachine)

    # helpers ---------------------------------------------------------------
    def admission_room(self) -> bool:
        """The spec's `admission_room`: an idle lane can always admit (at capacity), with
        preemption only when no lane is busy (the others may hold every block)."""
        return not self.c.PREEMPT or not any(self.s.busy)

    def quiescent(self) -> bool:
        """The spec's `quiescent`: no copy or load in flight, no block draining and no
        store to the host tier in flight."""
        return (not any(self.s.copying) and self.core.OWNER_DRAINING not in self.s.owner
                and self.core.SLOTSTATE_STORING not in self.s.slot_state)

    def apply(self, name: str, *args: Any, observe: bool = True) -> Any:
        """Run one action on the core and check everything about the step. observe: the
        policy observes its effects (the scheduler's own transitions: it does, itself)."""
        act, guard, _, _ = self.core.ACTIONS[name]
        Stats.calls += 1
        pre = self.s
        expect = self.life.predict(name, args)
        out = act(pre, *args)
        if out.rejected is None:
            post = out.state
            try:
                bad = self.core.check_invariants(post)
            except Exception as exc:  # a checker must report, not crash
                raise InvariantViolation("checker crash", [f"{CRASH}: {exc!r}"], name, args,
                                         self.core, pre, post) from exc
            if bad:
                raise InvariantViolation("invariant", bad, name, args, self.core, pre, post)
            bad = self.core.check_transition(pre, post)
            if bad:
                raise InvariantViolation("transition invariant", bad, name, args, self.core,
                                         pre, post)
        assert guard(pre, *args) == out.rejected, (name, args)
        plan = getattr(self.core, f"{name}_plan", None)
        if plan is not None:  # the effects the action would have, or the guard
            assert plan(pre, *args) == (out.effects if out.rejected is None
                                        else out.rejected), (name, args)
        if out.rejected != expect:
            raise LifecycleDivergence(name, args, expect, out.rejected)
        if out.rejected is None:
            Stats.applied[name] += 1
            self.s = out.state
            if observe:
                self.policy.observe(self.convert(e) for e in out.effects)
            self.life.apply(name, args, out.effects, pre,
                            post=out.state if self.core is committed else None)
        else:
            Stats.rejected[name, out.rejected] += 1
            assert out.state is pre and out.effects == ()
            if (out.rejected == "no_block_overflow" and self.c.T > 1
                    and any(map(self.life.table_end, range(self.c.B)))):
                Stats.events["decode refused at a full table"] += 1
        try:
            self.life.compare(self.core, self.s)
        except AssertionError as exc:
            self.diverged = True
            raise ModelDivergence(name, args, str(exc)) from exc
        if self.mirroring:
            self.mirror(name, args, out)
        if self.check_progress and self.at_capacity and self.quiescent():
            stuck = self.core.progress_violations(self.s)
            if stuck:
                raise ProgressViolation(stuck, name, args, self.core, self.s)
        return out

    def mirror(self, name: str, args: tuple[Any, ...], out: Any) -> None:
        pre2 = self.s2
        out2 = self.mcore.ACTIONS[name][0](pre2, *args)
        if out2.rejected != out.rejected:
            raise MirrorDivergence("rejected", name, args, out.rejected, out2.rejected)
        if tuple(map(tuple, out2.effects)) != tuple(map(tuple, out.effects)):
            raise MirrorDivergence("effects", name, args, out.effects, out2.effects)
        if out2.rejected is not None:
            assert out2.state is pre2
            return
        s2 = self.s2 = out2.state
        assert all(getattr(s2, f) is None for f in self.mcore.GHOST_FIELDS)
        for f in self.plain_fields:
            if getattr(s2, f) != getattr(self.s, f):
                raise MirrorDivergence(f, name, args, getattr(self.s, f), getattr(s2, f))
        assert self.mcore.check_invariants(s2) == []
        assert self.mcore.check_transition(pre2, s2) == []

    def lanes(self, data: Any, pred: Any) -> int:
        """A lane, from those satisfying `pred` when there are any."""
        good = [l for l in range(self.c.B) if pred(l)]
        if good and num(data, 0, 3, "any lane (0)"):
            return pick(data, good, "lane")
        return num(data, 0, self.c.B - 1, "lane")

    def any_request(self, data: Any) -> int:
        """A known request id (any phase) or one never submitted."""
        ids = sorted(self.life.status) + [self.next_id + 7]
        return pick(data, ids, "request")

    def waiting(self) -> list[int]:
        return sorted(r for r, x in self.life.status.items() if x == "waiting")

    def decode_tokens(self, data: Any) -> tuple[int, ...]:
        return tuple(data.draw(token_lists(self.c.B, self.c.B),
                               label="tokens"))

    # rules: the natural workload -----------------------------------------------
    @rule(data=st.data())
    def submit(self, data: Any) -> None:
        self.new_request(data)

    def new_request(self, data: Any, host: bool = False, short: bool = False) -> None:
        """A fresh prompt, or (multi-turn) a prefix of an earlier prompt or cache key
        (device or host) with a new tail, so deep prefix hits happen. host: a prompt
        that shares at least a chunk with a host entry, when there is one. Hybrid: often
        the next turn of a cached conversation (its whole key, generated tokens too), which
        matches further than the snapshots (taken over the prompt) reach. Paged tables:
        often the next turn of a conversation cached past its first block (the whole key
        of a later block's entry: the prefix up to its end), so that a hit goes on past
        the first block (`grow_hit`). short: a prompt that fits one block, else up to
        T * S - 1 tokens."""
        s, c = self.s, self.c
        m = c.S - 1 if short else c.T * c.S - 1
        stored = sorted({tuple(s.slot_key[h]) for h in range(c.H)
                         if s.slot_state[h] != self.core.SLOTSTATE_EMPTY})
        if host and stored:
            base = pick(data, stored, "host key")
            k = num(data, min(c.C, len(base)), len(base), "keep")
            p = seq((base[:k] + tuple(data.draw(token_lists(1, m), label="tail")))[:m])
        else:
            cached = sorted(set(stored) | {tuple(s.key[b]) for b in range(c.K)
                                           if s.owner[b] == self.core.OWNER_CACHE})
            earlier = sorted({tuple(p) for p in self.life.prompt.values()})
            how = num(data, 0, 2, "fresh, extend a cache key, extend an earlier prompt")
            # (a uniform draw among the keys rarely picks one past a first block, and a
            # uniform cut rarely keeps more than its first block)
            later = sorted({tuple(s.key[b]) for b in range(c.K) if s.start[b] > 0
                            and s.owner[b] == self.core.OWNER_CACHE}) if how == 1 else []
            if later and coin(data, "a later block's key"):
                base = pick(data, later, "later block's key")
            else:
                base = pick(data, cached, "cache key") if how == 1 and cached else (
                    pick(data, earlier, "earlier prompt") if how and earlier else None)
            if base:
                whole = how == 1 and (c.HYBRID or c.T > 1) and coin(data, "next turn")
                k = len(base) if whole else num(data, 1, len(base), "keep")
                tail = data.draw(token_lists(0, m), label="tail")
                p = seq((base[:k] + tuple(tail))[:m])
            else:
                p = data.draw(prompts(m), label="prompt")
        r = self.next_id
        self.next_id += 1
        assert self.apply("submit", r, p).rejected is None

    @precondition(lambda self: self.waiting())
    @rule(data=st.data())
    def admit(self, data: Any) -> None:
        """The scheduler's admissions (`scheduler_step` up to its call, a copy or load often
        left in flight); with paged tables and the prefix cache, often a hit on a later
        block's entry refused first, or a miss beside one (`miss_beside_later_block`)."""
        r = pick(data, self.waiting(), "request")
        if self.c.T > 1 and self.c.PREFIX:
            how = num(data, 0, 2, "plain, a later block first, a miss beside one")
            if how == 1:
                self.refuse_later_hit(data, r)
            elif how == 2 and self.miss_beside_later_block(data):
                return
        self.scheduler_step(data, in_flight=True, call=False)

    def miss_beside_later_block(self, data: Any = None) -> bool:
        """A miss beside an entry that starts later in its sequence (a full block of a
        cached table, or a tail after one) and shares the prompt's first chunk: the
        entries that start a sequence with that chunk are discarded, a prompt with it is
        submitted, a hit on the later entry is refused (src_first_block) and the scheduler
        admits it (its queue's last): a miss, which the later entry must not block (no hit
        can use it).
        Without data, the first such entry and a one-token tail. False if there is no such
        entry or no idle lane (or an entry to discard is pinned)."""
        s, c = self.s, self.c
        later = [b for b in range(c.K)
                 if s.owner[b] == self.core.OWNER_CACHE and s.start[b] != 0]
        if not later or all(s.busy) or "discard" not in self.core.ACTIONS:
            return False
        head = tuple(s.key[later[0] if data is None else pick(data, later, "entry")][:c.C])
        firsts = [b for b in range(c.K) if s.owner[b] == self.core.OWNER_CACHE
                  and s.start[b] == 0 and tuple(s.head[b]) == head]
        if any(self.life.pinned(b) for b in firsts):
            return False
        for b in firsts:
            assert self.apply("discard", b).rejected is None
        tail = ((ALPHABET[0],) if data is None
                else data.draw(token_lists(1, c.T * c.S - 1 - c.C), label="tail"))
        r = self.next_id
        assert self.apply("submit", r, seq(head + tuple(tail))).rejected is None
        self.next_id += 1
        self.refuse_later_hit(data, r)
        self.local(r, first=True)
        for _ in range(2):  # (a spill's store may be left in flight first)
            if r in self.life.lane or not self.scheduler_step(data, in_flight=True,
                                                              call=False):
                break
        if r in self.life.lane:  # (no block yet while a copy or a drain runs)
            l = self.life.lane.index(r)
            # (no device hit; a host entry of a first block may still hit: a load)
            assert self.life.status[r] == "prefill" and self.life.copy_src[l] is None, r
        return True

    @rule(data=st.data(), k=st.integers(1, 16))
    def advance(self, data: Any, k: int) -> None:
        """Up to k productive steps, whichever the draw picks: a step of the real scheduler
        (`scheduler_step`: it grows the lanes whose tail is full, admits, prefills a chunk,
        with the hybrid tier snapshotting at boundaries as the policy takes them, or
        decodes; a copy, load or store often left in flight; with paged tables and the
        prefix cache often a hit on a later block's entry refused first), complete a copy
        or a load left in flight, snapshot a lane at its next boundary, finish a decoding
        lane (the client's stop, keep drawn), with paged tables and the prefix cache a
        conversation's turn (`turn`); with pd, also a PD step (`pd_step`: import, export,
        end a transfer or a drain); with the host tier, a host step (`host_step`)."""
        for _ in range(k):
            life, c = self.life, self.c
            moves = []
            decoding = [l for l in range(c.B) if life.decoding(l)]
            if (self.waiting() and None in life.lane or decoding
                    or any(map(life.prefilling, range(c.B)))):
                moves += ["step"] * 3
            if any(life.copying):
                moves.append("copy_done")  # or a load's end
            if decoding:
                moves.append("finish")
            if self.pd and (life.draining or life.in_phase(*MOVING) or self.waiting()
                            or any(map(life.prefilled, range(c.B)))):
                moves.append("pd")
            if c.HOST and (life.entries or life.slots("STORING", "STORED", "LOADING")):
                moves.append("host")
            if any(map(life.snapshot_ok, range(c.B))):
                moves.append("snapshot")  # e.g. a decoding lane at a chunk boundary
            if c.T > 1 and c.PREFIX and None in life.lane:
                moves.append("turn")  # a conversation's turn: hits past the first block
            if not moves:
                return
            move = pick(data, moves, "move")
            if move == "step":
                waiting = self.waiting()
                if (waiting and c.T > 1 and c.PREFIX
                        and num(data, 0, 2, "a later block first (0)") == 0):
                    self.refuse_later_hit(data, pick(data, waiting, "request"))
                if not self.scheduler_step(data, in_flight=True):
                    return
            elif move == "copy_done":
                self.complete_copy(data, life.copying.index(True))
            elif move == "snapshot":
                l = pick(data, [l for l in range(c.B) if life.snapshot_ok(l)], "lane")
                assert self.apply("snapshot", l).rejected is None
            elif move == "host":
                self.host_step(data, feed=False)
            elif move == "pd":
                if not self.pd_step(data, feed=False):
                    return
            elif move == "turn":
                if not self.turn(data):
                    return
            else:
                l = pick(data, decoding, "lane")
                self.apply("finish", l, coin(data, "keep"))

    @invariant()
    def count_step(self) -> None:
        Stats.steps += 1
