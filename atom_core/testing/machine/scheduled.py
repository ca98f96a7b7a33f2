"""The real `Scheduler` driven by the machine: the scheduling loop is the serving code's
(`atom_core.scheduler`), never restated here; hypothesis chooses what the outside world
answers (each block work's outcome, each call's tokens, row errors or failure).

`MachineScheduler` is a `Scheduler` whose every transition (`Scheduler.transition`) goes through
the machine's `apply` (over the core under test, a mutant one too: every check of every step,
the lifecycle model, the mirror, progress), its state the machine's after each one. Its
views of what the core holds (the waiting queue, the requests, the block tables) are rebuilt
from the machine's state before each step (`sync`), so the machine's other rules, which take
the core's actions directly (adversarial interleavings the scheduler never makes: a copy left
in flight, a refused call, a drawn parameter), mix freely with its steps.

`SchedulerRules` (a mixin of the machine) takes scheduler steps (`scheduler_step`) and checks
the policy's refinement where the loop's choices show: every choice is one the spec accepts
(the core under test refuses nothing the scheduler asks), a hit past the first block is the
longest the spec accepts, and when the step's call is asked for, no lane that needs a block
could have had one, no admission the spec's progress rules promise was declined; a step with no
call while lanes decode had no padding target the spec accepts."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import hypothesis.strategies as st
from hypothesis.stateful import rule

from atom_core._generated import core as committed
from atom_core._generated import inplace
from atom_core.policy import prefer_host
from atom_core.scheduler import (
    CopyWork,
    CoreRejected,
    LoadWork,
    PrefillCall,
    Request,
    Scheduler,
    SnapshotWork,
    StepResult,
    StoreWork,
)
from atom_core.testing.lifecycle import ALPHABET, LATER_LOAD_FAILED, RUNNING, SNAPSHOT_CAP, Stats
from atom_core.testing.machine.errors import RefinementViolation
from atom_core.testing.strategies import num, pick

if TYPE_CHECKING:
    from atom_core.testing.machine.base import MachineBase

# A token no prompt holds (ALPHABET's are 1..3): the scheduler's requests end on it
EOS = 0
# max_new_tokens of the scheduler's requests: they end on EOS or at the table's end
UNBOUNDED = 10**6
# A block work's outcome that never comes in the step (`scheduler_step`'s in_flight)
LEFT_IN_FLIGHT = "left in flight"


@attrs.frozen
class SpecConfig:
    """The spec's constants as the `Scheduler` reads a `Config`. The machine's configurations
    are far below a runtime's shape rules (chunks of 1..2 tokens, blocks of 2..12), which
    `Config` refuses, and at or below the capacity rule; the scheduler reads only these."""

    c: Any

    def consts(self) -> committed.Consts:
        return committed.Consts(**attrs.asdict(self.c))

    @property
    def lanes(self) -> int:
        return self.c.B

    @property
    def kv_blocks(self) -> int:
        return self.c.K

    @property
    def prefill_chunk(self) -> int:
        return self.c.C

    @property
    def block_size(self) -> int:
        return self.c.S

    @property
    def blocks_per_table(self) -> int:
        return self.c.T

    @property
    def max_seq_len(self) -> int:
        return self.c.T * self.c.S

    @property
    def prefix_cache(self) -> bool:
        return self.c.PREFIX

    @property
    def scratch(self) -> str:
        return "reserved" if self.c.RESERVED else "dynamic"

    @property
    def sliding_window(self) -> int | None:
        return self.c.S if self.c.HYBRID else None  # (its size is the runtime's concern)

    @property
    def host_cache_blocks(self) -> int:
        return self.c.H

    @property
    def preemption(self) -> bool:
        return self.c.PREEMPT


class MachineScheduler(Scheduler):
    """A `Scheduler` over the machine's core (see the module doc)."""

    def __init__(self, machine: MachineBase) -> None:
        config: Any = SpecConfig(machine.c)  # (read as a Config: see SpecConfig)
        super().__init__(config, policy=machine.policy, keep_ended=None)
        self.machine = machine
        self.preempted_now: list[int] = []  # lanes preempted in the step in progress
        self.freed_late = False  # a lane freed in the step in progress since its last admission
        self.remote: dict[int, bool] = {}  # request -> imported (PD, decided at first sight)
        self.export: dict[int, bool] = {}  # request -> exported after its prefill
        self.limit: dict[int, int] = {}  # request -> its max_new_tokens
        self.data: Any = None  # what the step in progress draws from (None: no draws)
        self.sync()

    def sync(self) -> None:
        """Rebuild the views over the core (its state, the waiting queue in the scheduler's
        order, new requests last, the requests; the block tables, by `restore`) from the
        machine's."""
        m = self.machine
        self.restore(m.s)
        s, life = self.view, m.life
        waiting = {r for r, x in life.status.items() if x == "waiting"}
        queue = [r for r in self.waiting if r in waiting]
        queue += sorted(waiting - set(queue))
        self.waiting = deque(queue)
        self.requests = {}
        for r, x in life.status.items():
            if x != "waiting" and x not in RUNNING:
                continue
            prompt = list(s.prompt[r])
            lane = s.req_lane.get(r)
            tokens = list(s.lane_seq[lane][len(prompt):]) if lane is not None else []
            self.requests[r] = Request(r, prompt, self.limit.get(r, UNBOUNDED), EOS,
                                       remote=self.remote.get(r, False),
                                       export=self.export.get(r, False), tokens=tokens,
                                       owner=self)

    def transition(self, action: str, args: dict[str, Any]) -> committed.Step:
        """The scheduler's transition, through the machine's `apply` (every check; the
        policy observes it through the scheduler, as in serving); a step the core under test
        refuses is a choice the spec does not allow (refinement)."""
        m = self.machine
        pre = m.s
        m.before_scheduled(action, args)
        out = m.apply(action, *(args[k] for k in m.core.ACTIONS[action][2]), observe=False)
        if out.rejected is not None:
            raise RefinementViolation(action, f"the scheduler chose {args}, refused by "
                                      f"{out.rejected}", m.core, pre)
        if action == "preempt":
            self.preempted_now.append(args["l"])
            self.remote[pre.lane_req[args["l"]]] = False  # (it resumes locally)
        if action.startswith("admit_"):
            self.freed_late = False
        elif action in ("fail", "finish", "preempt", "export"):
            self.freed_late = True  # (a lane freed since the step's last admission)
        effects = tuple(map(m.convert, out.effects))
        return committed.Step(inplace.thaw(m.s), effects, None)  # type: ignore[arg-type]


class SchedulerRules:
    """A mixin of the core state machine (`MachineBase`'s attributes and helpers)."""

    @rule(data=st.data(), k=st.integers(1, 8))
    def schedule(self, data: Any, k: int) -> None:
        """Up to k steps of the real scheduler (`scheduler_step`), hypothesis answering its
        block work and calls."""
        for _ in range(k):
            if not self.scheduler_step(data):
                return

    def scheduler(self) -> MachineScheduler:
        sched = getattr(self, "_sched", None)
        if sched is None:
            sched = self._sched = MachineScheduler(self)
        return sched

    def before_scheduled(self, action: str, args: dict[str, Any]) -> None:
        """Refinement where the scheduler's choice shows: a hit past the first block is the
        longest the spec accepts (device, or host when longer), and a plain block is taken
        only when no hit may fill it; a victim is the policy's, never the oldest lane while
        another may go. Counts what the machine's coverage asks for."""
        data = self._sched.data
        if action in ("grow", "grow_hit", "grow_adopt", "grow_host_hit", "import_grow"):
            self.refine_growth(args["l"])
        if action in ("grow", "grow_hit", "grow_adopt", "grow_host_hit"):
            self.refine_scheduled_grow(action, args)
            if data is None:
                self.refuse_full_tail_undrawn(args["l"])
            elif num(data, 0, 2, "refused first (0)") == 0:
                self.refuse_full_tail(data, args["l"])
            if self.c.PREEMPT and (data is None or num(data, 0, 3, "preempt first (0)") == 0):
                # never while a block is reusable (the lane waits for one, every other
                # guard accepts)
                assert self.apply("preempt", args["l"]).rejected == "no_block_reusable"
        elif action == "import_grow":
            if data is not None and num(data, 0, 3, "refused first (0)") == 0:
                self.refuse_short_import(data, args["l"])
        elif action == "preempt":
            self.refine_scheduled_preempt(args["l"])
            if data is None or num(data, 0, 2, "refused first (0)") == 0:
                self.refuse_preempt(data)
        elif action == "spill":
            Stats.events["policy spill"] += 1
        elif action == "admit_host_hit":
            Stats.events["policy host hit"] += 1
        elif action == "admit_adopt":
            Stats.events["policy adopts a hit's source"] += 1
        elif action == "finish" and self.life.table_end(args["l"]):
            self.at_table_end(args["l"])  # (refused calls only: the step goes on as it was)

    def refine_growth(self, l: int) -> None:
        """The scheduler grows lane l: the policy's lanes (`Policy.growth`) are exactly those
        the lifecycle model says need a block (importing lanes short of their prompt too; with
        preemption in admission order), and l is the first of them."""
        life, c = self.life, self.c
        lanes = self.policy.growth(self.s)
        need = sorted((x for x in range(c.B)
                       if life.needs_block(x) or life.needs_import_block(x)),
                      key=life.admitted.__getitem__)
        if (sorted(lanes) != sorted(need) or (c.PREEMPT and lanes != need)
                or not lanes or lanes[0] != l):
            raise RefinementViolation("grow", f"grows lane {l} of {lanes}, the lifecycle "
                                      f"model says {need} (oldest first)", self.core, self.s)

    def refuse_full_tail_undrawn(self, l: int) -> None:
        """`refuse_full_tail` without draws: lane l's tail is full, so its next prefill
        chunk (or a decode call) and a grow into its own tail are refused."""
        life = self.life
        if life.prefilling(l):
            assert self.apply("prefill", l, ALPHABET[0]).rejected == "chunk_within_block"
        else:
            toks = (ALPHABET[0],) * self.c.B
            out = self.apply("decode", self.policy.pad(self.s), self.policy.local_pad(self.s),
                             toks)
            assert out.rejected == "no_block_overflow", out.rejected
        assert self.apply("grow", l, life.tail(l)).rejected == "dst_reusable"

    def refine_scheduled_grow(self, action: str, args: dict[str, Any]) -> None:
        """The scheduler grows prefilling lane l: a device hit is one of the longest the spec
        accepts (`longest_hits`), a host hit one of the longest host hits and longer than
        any device hit (`prefer_host`), a plain block only when no hit into any block is
        accepted."""
        life, l = self.life, args["l"]
        if not life.prefilling(l):
            return  # (a decoding lane's next block: no hit)
        longest = self.longest_hits(l)
        host = self.longest_host_hits(l) if self.c.HOST else []
        best = (longest[0] if longest else None)
        wanted = host[0] if host and prefer_host(best, host[0]) else None
        if action == "grow_host_hit":
            if (args["h"], args["n"]) not in host or wanted is None:
                raise RefinementViolation(action, f"lane {l}'s host hit {args}, the longest "
                                          f"the spec accepts {host}, device {longest}",
                                          self.core, self.s)
            Stats.events["policy host hit past the first block"] += 1
        elif action in ("grow_hit", "grow_adopt"):
            if (args["src"], args["n"]) not in longest:
                raise RefinementViolation(action, f"lane {l}'s hit {args}, the longest the "
                                          f"spec accepts {longest}", self.core, self.s)
            if action == "grow_adopt":
                Stats.events["policy grows into its hit's source"] += 1
        elif longest and any(self.core.grow_hit_guard(self.s, l, src, b, n) is None
                             for src, n in longest for b in range(self.c.K)):
            raise RefinementViolation("grow_hit", f"lane {l} takes a plain block, the spec "
                                      f"accepts the hits {longest}", self.core, self.s)
        if self.c.HYBRID and any(x == l for x, _, _ in self.later_hits_past_snapshot()):
            Stats.events[SNAPSHOT_CAP] += 1

    def refine_scheduled_preempt(self, victim: int) -> None:
        """The scheduler preempts `victim`: with several busy lanes, the oldest only when the
        spec accepts no other; counts why (a next block, an import's, a padding target)."""
        life, c = self.life, self.c
        ok = [ln for ln in range(c.B) if self.core.preempt_guard(self.s, ln) is None]
        busy = [ln for ln in range(c.B) if life.lane[ln] is not None]
        if len(busy) > 1 and victim == life.oldest():
            if ok != [victim]:
                raise RefinementViolation("preempt", f"preempts the oldest lane {victim} "
                                          f"(the spec accepts {ok})", self.core, self.s)
            Stats.events["oldest lane preempted: the only choice"] += 1
        if len(busy) == c.B > 1 and all(life.computing(ln) and life.tail_full(ln)
                                        for ln in busy):
            Stats.events["preempt storm: every lane at a block boundary"] += 1
        why = ("block of an import" if any(map(life.needs_import_block, range(c.B)))
               else "next block" if any(map(life.needs_block, range(c.B)))
               else "padding target")
        Stats.events[f"preempt for a {why}"] += 1
        if life.needs_block(victim):
            Stats.events["victim is a lane that waits"] += 1

    def scheduler_step(self, data: Any = None, in_flight: bool = False,
                       call: bool = True) -> bool:
        """One step of the real scheduler: its block work and call answered by the draw
        (without data: every work item done, the token `ALPHABET[0]`), checked at the call
        (`refine_at_call`) and at its end (`refine_at_end`). in_flight: a copy, load or store
        may be left in flight (often with data, always without): the step is abandoned
        there, the core keeps it in flight, and the machine's other rules end it (or cancel
        its request) between steps, as the outside world may. call: False abandons the step
        at its call (its growth and admission only: the call's outcome never comes). False
        if the step changed nothing (nothing to do, or a block to wait for)."""
        sched = self.scheduler()
        sched.sync()
        for r in sched.waiting:  # new requests: their length, imported or exported (PD)
            if r in sched.limit:
                continue
            if data is None:  # (odd ones end a block's worth of tokens in, as a client might)
                sched.limit[r] = self.c.S if r % 2 else UNBOUNDED
                continue
            sched.limit[r] = pick(data, (UNBOUNDED, 1, self.c.S), "max_new_tokens")
            sched.remote[r] = self.pd and num(data, 0, 3, "imported (0)") == 0
            sched.export[r] = (self.pd and not sched.remote[r]
                               and num(data, 0, 3, "exported (0)") == 0)
            req = sched.requests[r]
            req.max_new_tokens, req.remote, req.export = (
                sched.limit[r], sched.remote[r], sched.export[r])
        before = sched.version
        sched.preempted_now, sched.data, sched.freed_late = [], data, False
        called = False
        try:
            out = sched.schedule()
            while not out.done:
                if out.work:
                    outcomes = tuple(self.work_outcome(data, w, in_flight) for w in out.work)
                    if LEFT_IN_FLIGHT in outcomes:
                        sched.abandon()
                        Stats.events["scheduler's work left in flight"] += 1
                        self.refuse_hit_in_flight()
                        return True
                    out = sched.update(StepResult(work=outcomes))
                    continue
                assert out.call is not None
                self.refine_at_call()
                self.refuse_idle_preempt(data)
                self.refuse_early_grow()
                if not call:
                    sched.abandon()
                    return sched.version != before
                called = True
                out = sched.update(self.call_outcome(data, out.call, in_flight))
        except RuntimeError as exc:  # (CoreRejected is one, raised by no transition here)
            sched.abandon()
            assert not isinstance(exc, CoreRejected), exc
            if "no block for lane" not in str(exc):
                raise
            self.refine_no_block(str(exc))
            Stats.events["scheduler waits for a block"] += 1
            return sched.version != before
        finally:
            sched.abandon()  # (a check that failed mid-step: the step ends with it)
        if not called:
            self.refine_at_end()
        Stats.events["scheduler steps"] += 1
        return sched.version != before

    def refuse_hit_in_flight(self) -> None:
        """Once a run, with paged tables and the prefix cache: a prefilling lane whose copy
        or load the step left in flight is refused a hit past the first block
        (`no_copy_in_flight`). A refused call: nothing changes."""
        c, life = self.c, self.life
        if c.T < 2 or not c.PREFIX or Stats.rejected["grow_hit", "no_copy_in_flight"]:
            return
        for ln in range(c.B):
            if life.prefilling(ln) and life.copying[ln]:
                out = self.apply("grow_hit", ln, 0, 1 % c.K, c.C)
                assert out.rejected == "no_copy_in_flight", out.rejected
                return

    def ungrown_lane(self) -> tuple[int, list[int]] | None:
        """The first lane that needs its next block (a grow, or an importing lane's
        import_grow) while the spec accepts some block for it, with those blocks; None if
        there is none."""
        life, c, s = self.life, self.c, self.s
        for ln in range(c.B):
            if life.needs_block(ln):
                ok = [b for b in range(c.K) if self.core.grow_guard(s, ln, b) is None]
            elif life.needs_import_block(ln):
                ok = [b for b in range(c.K) if self.core.import_grow_guard(s, ln, b) is None]
            else:
                continue
            if ok:
                return ln, ok
        return None

    def refine_no_block(self, why: str) -> None:
        """The scheduler found no block for a lane that needs one, with nothing in flight:
        the spec accepts none either, and (quiescent, at capacity) the lane may wait only
        where the spec lets it (an import, for another lane's transfer or a lane at its
        table's end: `import_may_wait`)."""
        life, c, s = self.life, self.c, self.s
        ungrown = self.ungrown_lane()
        if ungrown is not None:
            ln, ok = ungrown
            raise RefinementViolation("grow", f"{why} (the spec accepts {ok} for lane {ln})",
                                      self.core, s)
        waits = [ln for ln in range(c.B) if life.needs_import_block(ln)
                 and self.import_may_wait(ln)]
        if self.quiescent() and self.at_capacity and not waits:
            raise RefinementViolation("grow", why, self.core, s)

    def work_outcome(self, data: Any, work: Any, in_flight: bool = False) -> str | None:
        """A block work's outcome: done (None), its failure, or (in_flight) left in flight
        (`LEFT_IN_FLIGHT`: often with data, a copy's, load's or store's always without).
        in_flight (the flows' steps, whose situations need requests that live): a copy
        rarely fails (a load, a store or a snapshot's fetch as often as the flows' own
        draws end them). Without data the first load into a later block of a run fails (so
        that coverage does not hang on the draws)."""
        if in_flight and isinstance(work, (CopyWork, LoadWork, StoreWork)) and (
                data is None or num(data, 0, 2, "left in flight (0)") == 0):
            return LEFT_IN_FLIGHT
        if data is None:
            later = (isinstance(work, LoadWork) and len(self.life.tables[work.lane]) > 1
                     and not Stats.events[LATER_LOAD_FAILED])
            return "LoadWork failed" if later else None
        odds = (19 if isinstance(work, CopyWork) else 7 if isinstance(work, SnapshotWork)
                else 2) if in_flight else 4
        if num(data, 0, odds, "work fails (0)"):
            return None
        Stats.events[f"{type(work).__name__} failed"] += 1
        return f"{type(work).__name__} failed"

    def local(self, r: int, limit: int = UNBOUNDED, first: bool = False) -> None:
        """Waiting request r is served here (not imported, not exported), up to `limit`
        tokens, whatever the scheduler's steps would draw for it. first: it heads the
        scheduler's waiting queue (it arrived before the others waiting)."""
        sched = self.scheduler()
        sched.limit[r], sched.remote[r], sched.export[r] = limit, False, False
        if first:
            sched.sync()
            sched.waiting.remove(r)
            sched.waiting.appendleft(r)

    def prefill_request(self, data: Any, r: int,
                        between: Callable[[int], None] | None = None) -> int | None:
        """Scheduler steps (`scheduler_step`, work sometimes left in flight) until request r
        decodes; before each, `between(lane)` once r has a lane (drawn calls at its state), and
        a copy or load left in flight into it ends (`complete_copy`). r's lane, or None if r
        did not get there (it ended, or a step changed nothing, or the bound was reached)."""
        life, c = self.life, self.c
        for _ in range(4 * c.T * c.S + 2 * c.B):  # (each step admits, grows or prefills)
            l = life.lane.index(r) if r in life.lane else None
            if l is None and life.status[r] != "waiting":
                return None  # ended
            if l is not None and life.decoding(l):
                return l
            if l is not None and between is not None:
                between(l)
                if life.lane[l] != r:
                    continue  # cancelled
            if l is not None and life.copying[l]:
                self.complete_copy(data, l)
                continue
            if not self.scheduler_step(data, in_flight=True):
                return None
        return None

    def decode_request(self, data: Any, r: int, l: int, steps: int) -> bool:
        """Up to `steps` scheduler steps while r decodes in lane l, then the client finishes
        it (`Scheduler.finish`: into the cache). False if r no longer decodes there
        (preempted, or ended by the scheduler)."""
        life = self.life
        for _ in range(steps):
            if life.lane[l] != r or not life.decoding(l):
                break
            if not self.scheduler_step(data, in_flight=True):
                break
        if life.lane[l] != r or not life.decoding(l):
            return False
        self.client_finish(r)
        return True

    def client_finish(self, r: int) -> None:
        """The client stops decoding request r (`Scheduler.finish`: into the cache)."""
        sched = self.scheduler()
        sched.sync()
        sched.finish(r)

    def call_outcome(self, data: Any, call: Any, rare: bool = False) -> StepResult:
        """A call's outcome: its tokens (EOS ends a request), a row's error, or the call's
        (rare: the flows' steps, whose situations need requests that live)."""
        rows = 1 if isinstance(call, PrefillCall) else len(call.ids)
        if data is None:
            return StepResult(tokens=(ALPHABET[0],) * rows)
        how = num(data, 0, 39 if rare else 9, "call: fails (0), a row fails (1), tokens")
        if how == 0:
            Stats.events[f"{type(call).__name__} failed"] += 1
            return StepResult(error="the call failed")
        # (rare: EOS one token in ten, so that the flows' requests run on past a block)
        ends = (*ALPHABET * 3, EOS) if rare else (*ALPHABET, EOS)
        toks = tuple(pick(data, ends, "token") for _ in range(rows))
        errors: tuple[str | None, ...] = ()
        if how == 1:
            bad = num(data, 0, rows - 1, "row")
            errors = tuple("a row failed" if i == bad else None for i in range(rows))
            Stats.events["row failed"] += 1
        return StepResult(tokens=toks, row_errors=errors)

    def refine_at_call(self) -> None:
        """When the scheduler asks for its call, its growth and admission are over: no lane
        that needs its next block could have had one the spec accepts; no admission the
        progress rules promise (an idle lane, a waiting local request at the queue's head, at
        capacity, quiescent) was declined."""
        life, s = self.life, self.s
        ungrown = self.ungrown_lane()
        if ungrown is not None:
            ln, ok = ungrown
            raise RefinementViolation("grow", f"lane {ln} calls without its next block "
                                      f"(the spec accepts {ok})", self.core, s)
        sched = self._sched
        head = sched.waiting[0] if sched.waiting else None
        if (head is not None and not sched.requests[head].remote and not sched.freed_late
                and None in life.lane
                and self.quiescent() and self.at_capacity and self.admission_room()):
            raise RefinementViolation("admission", f"declines a quiescent admission of "
                                      f"{head}", self.core, s)

    def refuse_idle_preempt(self, data: Any) -> None:
        """At the call, with preemption: every lane that needed a block has one, so a
        computing lane's preemption is refused (`a_lane_waits_for_a_block`: no lane waits for
        one; often, or without data once a run). A refused call: nothing changes."""
        life, c = self.life, self.c
        if not c.PREEMPT or life.waits_for_block():
            return
        computing = [ln for ln in range(c.B) if life.computing(ln)]
        if not computing or (num(data, 0, 3, "preempt refused (0)") if data is not None
                             else Stats.rejected["preempt", "a_lane_waits_for_a_block"]):
            return
        ln = computing[0] if data is None else pick(data, computing, "lane")
        assert self.apply("preempt", ln).rejected == "a_lane_waits_for_a_block"

    def refuse_early_grow(self) -> None:
        """At the call, once a run: a computing lane with room left in its tail block is
        refused its next block (`tail_full`). A refused call: nothing changes."""
        if Stats.rejected["grow", "tail_full"]:
            return
        life = self.life
        for ln in range(self.c.B):
            if life.computing(ln) and not life.tail_full(ln):
                dst = self.policy.reusable(self.s)
                out = self.apply("grow", ln, 0 if dst is None else dst)
                assert out.rejected == "tail_full", out.rejected
                return

    def refine_at_end(self) -> None:
        """A step with no call while lanes decode (none at its table's end, no preemption in
        the step) found no padding target: none exists the spec accepts."""
        life, c, s = self.life, self.c, self.s
        if (self._sched.preempted_now or not any(map(life.decoding, range(c.B)))
                or any(life.decoding(ln) and life.tail_full(ln) for ln in range(c.B))
                or any(life.prefilling(ln) for ln in range(c.B))):
            return
        toks = (ALPHABET[0],) * c.B
        ok = [(b, x) for b in range(c.K) for x in range(c.B)
              if self.core.decode_guard(s, b, x, toks) is None]
        if ok:
            raise RefinementViolation("decode", f"no call, the spec accepts the padding "
                                      f"targets {ok}", self.core, s)
        Stats.events["decode waits for a padding target"] += 1

