"""The Scheduler: the core state, the policy and the step's loop (see the package doc)."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from itertools import compress
from operator import not_
from typing import IO, Any

import attrs

from atom_core._generated import choices, core, inplace
from atom_core.config import Config
from atom_core.policy import Policy
from atom_core.replay import record
from atom_core.scheduler.records import (
    CopyWork,
    CoreRejected,
    DecodeCall,
    Event,
    InvariantViolation,
    LoadWork,
    MixedCall,
    PrefillCall,
    Request,
    SnapshotWork,
    Stats,
    StepOutput,
    StepResult,
    StoreWork,
    Work,
    as_integer,
    as_token,
)
from atom_core.seq import seq

_Loop = Generator[StepOutput, StepResult, list[Event]]
# the effects that change a lane's block table (`_apply` keeps `tables` from them)
_TABLE_EFFECTS = (core.Admit, core.Inbound, core.Grow, core.Release, core.Preempt)


class _Uncached:
    """The live requests that take no prefix-cache hit (`Request.uncached`)."""

    def __init__(self, requests: dict[int, Request]) -> None:
        self._requests = requests

    def __contains__(self, rid: object) -> bool:
        req = self._requests.get(rid)  # type: ignore[call-overload]
        return req is not None and req.uncached


class Scheduler:
    def __init__(self, config: Config, *, policy: Policy | None = None, ghost: bool = False,
                 trace: IO[str] | None = None, keep_ended: int | None = 10_000,
                 vocab_size: int | None = None, mixed: bool = False,
                 prefill_tokens: int | None = None) -> None:
        """`keep_ended`: how many ended requests keep their `requests` entry (tokens, error)
        for the caller to read; older ones are forgotten (the core's `forget`), so memory does
        not grow with the requests served. None keeps every one. `vocab_size`: the model's
        (prompts and end tokens are checked against it), None if unknown. `mixed`: the runtime
        takes a decode and prompt chunks in one call (`MixedCall`): a step with a lane to
        prefill asks for the decode (if a lane decodes) and a chunk of each lane that can
        prefill, while their tokens fit `prefill_tokens` (default: one chunk), at once."""
        if keep_ended is not None and (isinstance(keep_ended, bool)
                                       or not isinstance(keep_ended, int) or keep_ended < 0):
            raise ValueError(f"keep_ended must be an integer >= 0 or None, got {keep_ended!r}")
        self.keep_ended = keep_ended
        self._ended: deque[int] = deque()  # ended requests in the order they ended
        self.config = config
        self.vocab_size = vocab_size
        self.policy = policy or Policy()
        self.mixed = mixed
        self.prefill_tokens = config.prefill_chunk if prefill_tokens is None else prefill_tokens
        # the core state, changed in place by each transition (`_apply`); `version` counts the
        # transitions, so a pending plan can tell whether the state moved since it was made
        self._m = inplace.init(config.consts(), ghost=ghost)
        self.version = 0
        self._frozen: tuple[int, core.State] | None = None
        self.requests: dict[int, Request] = {}
        # the requests the policy gives no prefix hit: read from the requests themselves, so
        # an ended one leaves nothing behind
        self.policy.uncached = _Uncached(self.requests)
        self.waiting: deque[int] = deque()
        self.stats = Stats()
        self._next_id = 0
        # each lane's block table in token order, kept from the core's effects (admit, grow,
        # release): the spec has no table state yet; and the same padded with its tail to T
        # blocks (positions past a lane's length are never read, nothing is written there)
        self.tables: list[list[int]] = [[] for _ in range(config.lanes)]
        self._t = config.blocks_per_table  # (a Config property: read once, not per effect)
        self._splits: dict[tuple[bool, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._rows: list[tuple[int, ...]] = [(0,) * self._t] * config.lanes
        # called with the effects of every applied transition (the executor's snapshot buffers)
        self.listeners: list[Callable[[Sequence[Any]], None]] = []
        self._trace = trace
        self._loop: _Loop | None = None  # the step in progress
        if trace is not None:
            trace.write(json.dumps({"consts": attrs.asdict(config.consts())}) + "\n")

    # --------------------------------------------------------------- core state
    @property
    def state(self) -> core.State:
        """The core state, frozen (see `AtomBatcher.state`)."""
        if self._frozen is None or self._frozen[0] != self.version:
            self._frozen = (self.version, inplace.freeze(self._m))
        return self._frozen[1]

    @property
    def view(self) -> inplace.MState:
        """The core state itself, live: read it, never write it."""
        return self._m

    def phase(self, request_id: int) -> int:
        return self._m.phase.get(request_id, core.PHASE_NONE)

    def busy(self) -> bool:
        s = self._m
        return bool(self.waiting) or any(s.busy) or any(s.transfer)

    # --------------------------------------------------------------- the step
    def schedule(self) -> StepOutput:
        """Start a step: its first block work, or its call, or (nothing to compute) its end."""
        if self._loop is not None:
            raise RuntimeError("schedule() while a step is in progress: update() it to its end")
        self._loop = self._step()
        return self._resume(None)

    def update(self, result: StepResult) -> StepOutput:
        """The outcome of what the last output asked; returns the step's next output."""
        if self._loop is None:
            raise RuntimeError("update() without a step in progress: call schedule() first")
        return self._resume(result)

    def abandon(self) -> None:
        """Drop the step in progress (its call's outcome will never come)."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    @property
    def in_step(self) -> bool:
        return self._loop is not None

    def _resume(self, result: StepResult | None) -> StepOutput:
        assert self._loop is not None
        try:
            return self._loop.send(result)  # type: ignore[arg-type]
        except StopIteration as stop:
            self._loop = None
            return StepOutput(events=tuple(stop.value), done=True)
        except BaseException:
            self._loop = None
            raise

    def _step(self) -> _Loop:
        events: list[Event] = []
        # running lanes get their next blocks before an admission can take them, and an
        # admission whose hit fills its first block grows before the next call
        if self.policy.growth(self._m):  # (most steps grow no lane: no generator for it)
            yield from self._grow(events)
        before = self.version
        if self.waiting:  # (nor for an admission with none waiting)
            yield from self._admit(events)
        if self.version != before:  # (else the state is the one the first pass left: no lane
            yield from self._grow(events)  # needs a block, and asking again costs B checks)
        lane = self.policy.prefill_lane(self._m)
        if lane is not None and self.mixed:
            yield from self._mixed(events)
            return events
        if lane is not None and not self.policy.prefill_first(self._m, self._can_decode):
            lane = None  # decoding lanes waited long enough: a decode call goes first
        if lane is not None:
            pcall = self._prefill_call(lane)
            result = yield StepOutput(call=pcall, events=tuple(events))
            yield from self._prefilled(pcall, result, events)
            return events
        dcall = ((yield from self._decode_call(events)) if self.config.host_cache_blocks
                 else self._decode_now(events))
        if dcall is not None:
            result = yield StepOutput(call=dcall, events=tuple(events))
            self._decoded(dcall, result, events)
        return events

    def _mixed(self, events: list[Event]) -> Generator[StepOutput, StepResult, None]:
        """A step for a runtime that takes several rows of either kind in one call: the
        decode (if a lane decodes) and a prompt chunk of as many lanes as `prefill_tokens`
        allows (at least one), applied in that order."""
        dcall = None
        if self._can_decode():
            # (a decode call is possible without a preemption, so none happens here; a spill
            # may, which leaves the lanes as they are: the prefill lanes are chosen after it)
            dcall = ((yield from self._decode_call(events)) if self.config.host_cache_blocks
                     else self._decode_now(events))
        pcalls: list[PrefillCall] = []
        budget = self.prefill_tokens
        for ln in self.policy.prefill_lanes(self._m):
            pcall = self._prefill_call(ln)
            budget -= pcall.end - pcall.start
            if pcalls and budget < 0:
                break
            pcalls.append(pcall)
        result = yield StepOutput(call=MixedCall(dcall, tuple(pcalls)), events=tuple(events))
        rows = len(dcall.ids) if dcall is not None else 0
        if dcall is not None:
            self._decoded(dcall, StepResult(error=result.error, tokens=result.tokens[:rows],
                                            row_errors=result.row_errors[:rows]), events)
        for i, pcall in enumerate(pcalls):
            row = slice(rows + i, rows + i + 1)
            yield from self._prefilled(pcall, StepResult(
                error=result.error, tokens=result.tokens[row],
                row_errors=result.row_errors[row]), events)

    def _ask(self, work: Work, events: list[Event]) -> Generator[StepOutput, StepResult,
                                                                  str | None]:
        result = yield StepOutput(work=(work,), events=tuple(events))
        (outcome,) = result.work
        return outcome

    # --------------------------------------------------------------- growth and admission
    def _grow(self, events: list[Event]) -> Generator[StepOutput, StepResult, None]:
        """Every lane whose tail block is full gets its next block before the next call
        (decode is one call over every row, so all of them at once), the oldest lane first, as
        the policy chooses (`Policy.grow`): a plain block, a cached continuation copied
        (`grow_hit`), loaded from the host tier (`grow_host_hit`) or taken over when its
        entry is the last block (`grow_adopt`), or a victim preempted to free one."""
        while lanes := self.policy.growth(self._m):
            lane = lanes[0]
            choice = self.policy.grow(self._m, lane)
            if choice is None:
                if self.policy.in_flight(self._m):
                    return  # a block frees when a transfer or store ends: wait for it
                # with nothing in flight, the capacity rule Config checks excludes this
                raise RuntimeError(f"no block for lane {lane}'s next block: kv_blocks is "
                                   "below the capacity rule (Config checks it; was it bypassed?)")
            if isinstance(choice, choices.Preempt):
                self._preempt_lane(choice.l, events)
                continue
            # (an adoption takes the hit's own block: no other block to free first)
            taken = None if isinstance(choice, choices.GrowAdopt) else choice.dst
            if (yield from self._spilled(taken)):
                continue  # the entry went to the host tier; its block is free now: choose again
            self.stats.table_grows += 1
            yield from self._dispatch(self._apply(choice.action, **choice.args), events)
            if isinstance(choice, choices.GrowAdopt):  # a hit with nothing to copy
                self.stats.prefix_hit_tokens += choice.n

    def _admit(self, events: list[Event]) -> Generator[StepOutput, StepResult, None]:
        while self.waiting:
            rid = self.waiting[0]
            if rid in self.policy.uncached and not self._dropped_hits(rid):
                return  # a copy in flight reads an entry it would hit: the next step
            choice = self.policy.admission(self._m, rid, remote=self.requests[rid].remote)
            if choice is None:
                return
            taken = None if isinstance(choice, choices.AdmitAdopt) else choice.dst
            if (yield from self._spilled(taken)):
                continue  # the entry went to the host tier; its block is free now: choose again
            self.waiting.popleft()
            yield from self._dispatch(self._apply(choice.action, **choice.args), events)
            if isinstance(choice, choices.AdmitAdopt):  # a hit with nothing to copy
                self.stats.prefix_hit_tokens += choice.n

    def _dropped_hits(self, rid: int) -> bool:
        """Discard the cache entries request `rid` would hit, so that its admission computes
        its whole prompt (the spec's admission takes a hit whenever one exists:
        `no_cache_hit`); the policy skips its host-tier and growth hits (`uncached`). False
        when an entry cannot be discarded now (a copy in flight reads it)."""
        while (hit := self.policy.best_hit(self._m, self._m.prompt[rid])) is not None:
            if not inplace.enabled_discard(self._m, b=hit[0]):
                return False
            self._apply("discard", b=hit[0])
        return True

    def _spilled(self, block: int | None) -> Generator[StepOutput, StepResult, bool]:
        """Spill before evict, the one place it is decided: a choice that would evict cache
        entry `block` (a growth's or an admission's block, a dynamic padding target) stores it
        into the host tier first, evicting the least recently used host entry when every slot
        is full. False if there is no host tier, `block` (None: the choice takes no block) is no
        cache entry, no slot can take it, or the host tier already holds it (the device entry is
        then simply evicted). A failed store drops the entry; either way the block is free
        afterwards, so the caller chooses again."""
        if (not self.config.host_cache_blocks or block is None
                or self._m.owner[block] != core.OWNER_CACHE):
            return False
        place = self.policy.spill_slot(self._m, block)
        if place is None:
            return False
        slot, evict = place
        if evict:
            self._apply("host_evict", h=slot)
        yield from self._dispatch(self._apply("spill", b=block, h=slot), [])
        return True

    def _dispatch(self, step: core.Step, events: list[Event]) -> Generator[StepOutput,
                                                                           StepResult, None]:
        """Ask for what an applied choice's effects need done, in their order: a prefix hit's
        copy (`Copy`), a host-tier load (`Load`), a store into the host tier (`Store`); and ask
        for an import's KV once its table covers the prompt (`Inbound`, `Grow`)."""
        for eff in step.effects:
            kind = type(eff)
            if kind is core.Copy:
                failed = yield from self._ask(
                    CopyWork(eff.lane, eff.src, eff.dst, eff.n, self._m.length[eff.lane]),
                    events)
                if failed is not None:  # a failed copy fails its request only
                    self._end(eff.lane, events, failed)
                else:
                    self._apply("copy_done", l=eff.lane)
                    self.stats.prefix_hit_tokens += eff.n
            elif kind is core.Load:
                failed = yield from self._ask(LoadWork(eff.lane, eff.slot, eff.dst, eff.n),
                                              events)
                if failed is not None:  # the request recomputes; the host entry is intact
                    self._apply("load_fail", l=eff.lane)
                    self.stats.host_load_failures += 1
                else:
                    self._apply("load_done", l=eff.lane)
                    self.stats.host_hit_tokens += eff.n
            elif kind is core.Store:
                failed = yield from self._ask(StoreWork(eff.block, eff.slot), events)
                if failed is not None:  # only this entry is lost; its block is free either way
                    self._apply("store_fail", h=eff.slot)
                    self.stats.host_store_failures += 1
                else:
                    self._apply("store_done", h=eff.slot)
                    self.stats.host_stores += 1
            elif kind is core.Inbound or kind is core.Grow:
                self._import_ready(eff.lane, events)

    def _import_ready(self, lane: int, events: list[Event]) -> None:
        """Ask for lane's KV ("import") once its table covers the prompt: the core refuses to
        grow it further exactly then."""
        s = self._m
        if inplace.importing(s, lane) and inplace.table_covers_prompt(s, lane):
            events.append(Event("import", s.lane_req[lane]))

    # --------------------------------------------------------------- preemption
    def _preempt_lane(self, lane: int, events: list[Event]) -> None:
        """Free a lane's blocks for a lane that waits for one; its request goes to the front
        of the waiting queue and, when admitted again, prefills its prompt and the tokens it
        has so far, so its next token is the one it would have decoded."""
        rid, lost = self._m.lane_req[lane], self._m.length[lane]
        self._apply("preempt", l=lane)
        # An imported request resumes here, by recomputing its prompt and tokens as any
        # preempted request does: its prefill worker knows none of the tokens decoded since, so
        # asking it again would cost a round trip and a transfer for the prompt alone, and would
        # depend on that worker still being alive.
        self.requests[rid].remote = False
        self.waiting.appendleft(rid)
        self.stats.preemptions += 1
        self.stats.recomputed_tokens += lost
        events.append(Event("preempted", rid))

    # --------------------------------------------------------------- prefill
    def _can_decode(self) -> bool:
        """A decode call with a live row is possible now, without a preemption or a spill: the
        core's plan for it (`decode_plan`, which changes nothing) with the policy's padding
        targets. (`_decode_call` preempts when there is no padding target: asked only when no
        lane can prefill, never to make room for a decode call a prefill could replace.)"""
        s = self._m
        plan = inplace.decode_plan(s, self.policy.pad(s), self.policy.local_pad(s), None)
        return not isinstance(plan, str) and any(plan[0].live)

    def _prefill_call(self, lane: int) -> PrefillCall:
        (eff,) = inplace.prefill_plan(self._m, lane, None)
        rid = self._m.lane_req[lane]
        req = self.requests[rid]
        prompt = req.prompt
        total = len(prompt) + len(req.tokens)  # after a preemption: its tokens so far too
        chunk = (prompt[eff.start:eff.end] if eff.end <= len(prompt)  # (no copy of the rest)
                 else (prompt + req.tokens)[eff.start:eff.end])
        assert self.tables[lane][eff.start // self.config.block_size] == eff.block, eff
        # hybrid: the lane's own local slot (local_block_tables[lane] == lane)
        local = lane if self.config.sliding_window is not None else None
        return PrefillCall(lane, rid, tuple(chunk), eff.start, eff.end, self._rows[lane], local,
                           emits=eff.end == total, effect=eff)

    def _prefilled(self, call: PrefillCall, result: StepResult,
                   events: list[Event]) -> Generator[StepOutput, StepResult, None]:
        lane, rid = call.lane, call.request
        if result.error is not None:
            self._end(lane, events, f"prefill failed: {result.error}")
            return
        if result.row_errors and result.row_errors[0] is not None:
            self._end(lane, events, result.row_errors[0])
            return
        tok = result.tokens[0] if result.tokens else 0
        self.stats.prefill_tokens += call.end - call.start
        (eff,) = self._apply("prefill", l=lane, tok=tok).effects[:1]
        # the chunk computed is the one the core records (after a mixed call's decode too)
        assert (eff.start, eff.end) == (call.start, call.end), (eff, call)
        if (self.config.prefix_cache and self.config.sliding_window is not None
                and self.policy.snapshot(self._m, lane)):
            # a failed fetch costs only later hits their snapshot (the core then allows none)
            if (yield from self._ask(SnapshotWork(lane), events)) is None:
                self._apply("snapshot", l=lane)
                self.stats.snapshots += 1
            else:
                self.stats.snapshot_failures += 1
        if call.emits:
            if self.requests[rid].export:
                self._apply("export", l=lane)
                events.append(Event("export", rid, token=tok))
            else:
                self._emit_token(lane, tok, events)

    # --------------------------------------------------------------- decode
    def _decode_call(self, events: list[Event]) -> Generator[StepOutput, StepResult,
                                                             DecodeCall | None]:
        """The decode call over every row, or None (no lane decodes, or no padding target:
        with preemption a victim is preempted then); `_decode_now` without a host tier."""
        while True:
            plan = self._decode_plan(events)
            if plan is None:
                return None
            eff, pad, lpad = plan
            if all(eff.live) or not (yield from self._spilled(pad)):
                return self._decode_of(eff, pad, lpad)
            # padding would evict that entry: it went to the host tier first; choose again

    def _decode_now(self, events: list[Event]) -> DecodeCall | None:
        """`_decode_call` without a host tier, where no spill can come first: a plain call
        (a decode step then makes no generator for it)."""
        assert not self.config.host_cache_blocks
        plan = self._decode_plan(events)
        return None if plan is None else self._decode_of(*plan)

    def _decode_plan(self, events: list[Event]) -> tuple[Any, int, int] | None:
        """The core's plan of a decode call with the policy's padding targets (its effect,
        `pad`, `lpad`), or None."""
        s = self._m
        pad, lpad = self.policy.pad(s), self.policy.local_pad(s)
        plan = inplace.decode_plan(s, pad, lpad, None)
        if isinstance(plan, str):
            # no lane decodes, or no padding target yet: a prefill comes first, or (with
            # preemption, every block held by lanes) a lane makes room; or (hybrid) every
            # lane is busy and one is not decoding, so no local slot may take padding:
            # that lane prefills or its transfer ends first
            if self.config.preemption:
                victim = self.policy.victim(s)
                if victim is not None:
                    self._preempt_lane(victim, events)
            return None
        return plan[0], pad, lpad

    def _decode_of(self, eff: Any, pad: int, lpad: int) -> DecodeCall | None:
        """The call of decode plan `eff` (None if no row is live)."""
        live = eff.live
        lanes, padding = self._split(live)
        if not lanes:
            return None
        s, size, t, b = self._m, self.config.block_size, self._t, len(live)
        # a padding row: the padding target at every position, so its write lands there
        # whatever position the row computes (one tuple per target, shared by its rows)
        rows = eff.rows
        tables: list[Any] = [None] * b
        if padding:
            targets = set(map(rows.__getitem__, padding))
            if len(targets) == 1:  # (the spec's one `pad`: every row starts as its table)
                tables = [(*targets,) * t] * b
            else:
                tables = list(map({r: (r,) * t for r in targets}.get, rows))
        ids = [0] * b
        requests: list[int | None] = [None] * b
        for ln in lanes:
            # a decoding row: its lane's table (its write lands in the block the spec names)
            rid = s.lane_req[ln]
            assert self.tables[ln][eff.positions[ln] // size] == rows[ln], (self.tables[ln], eff)
            ids[ln], requests[ln], tables[ln] = self.requests[rid].tokens[-1], rid, self._rows[ln]
        # hybrid: the local slot the spec gives each row (a decoding lane its own; padding rows
        # an idle lane's, whose window they may overwrite)
        local = tuple(eff.local) if self.config.sliding_window is not None else None
        return DecodeCall(tuple(ids), tuple(eff.positions), tuple(tables), local, lanes,
                          tuple(requests), padding, pad, lpad, effect=eff)

    def _split(self, live: Sequence[bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The live rows of a decode and its padding rows. Remembered per pattern: it changes
        only when a lane starts or stops decoding, not from one step to the next."""
        live = live if type(live) is tuple else tuple(live)  # (a key: another core's list)
        split = self._splits.get(live)
        if split is None:
            if len(self._splits) >= 1024:  # (B > 10 lanes have more patterns than steps)
                self._splits.clear()
            rows = range(len(live))
            split = self._splits[live] = (tuple(compress(rows, live)),
                                          tuple(compress(rows, map(not_, live))))
        return split

    def _decoded(self, call: DecodeCall, result: StepResult, events: list[Event]) -> None:
        if result.error is not None:
            # Every row was computed, so every row's target may be half-written.
            for ln in call.lanes:
                self._end(ln, events, f"decode failed: {result.error}")
            if call.padding:
                self._apply("discard", b=call.pad)
            return
        bad = result.row_errors or (None,) * len(result.tokens)
        self.stats.decode_steps += 1
        self.stats.decode_rows_padding += len(call.padding)
        self._apply("decode", pad=call.pad, lpad=call.lpad, tok=tuple(result.tokens))
        for ln in call.lanes:
            if bad[ln] is not None:
                self._end(ln, events, bad[ln])
            else:
                self._emit_token(ln, result.tokens[ln], events)

    # --------------------------------------------------------------- ends
    def _end(self, lane: int, events: list[Event], error: str | None) -> None:
        rid = self._m.lane_req[lane]
        req = self.requests[rid]
        if error is None:
            self._apply("finish", l=lane, keep=self.config.prefix_cache)
            events.append(Event("finished", rid))
        else:
            self._apply("fail", l=lane)
            self.stats.runtime_errors += 1
            req.error = error
            events.append(Event("error", rid, error=error))
        self._ended_now(rid)

    def _emit_token(self, lane: int, tok: int, events: list[Event]) -> None:
        rid = self._m.lane_req[lane]
        req = self.requests[rid]
        req.tokens.append(tok)
        self.stats.generated_tokens += 1
        events.append(Event("token", rid, token=tok))
        full = self._m.length[lane] >= self.config.max_seq_len
        if (tok == req.eos_token_id or len(req.tokens) >= req.max_new_tokens or full):
            self._end(lane, events, None)

    def _ended_now(self, rid: int) -> None:
        if self.keep_ended is not None:
            self._ended.append(rid)
            self._trim_ended()

    def _trim_ended(self) -> None:
        """Forget the oldest ended requests past `keep_ended`; one whose blocks still drain
        (its transfer's end will name it) holds back the rest until that end."""
        if self.keep_ended is None:
            return
        while len(self._ended) > self.keep_ended and inplace.enabled_forget(self._m,
                                                                          r=self._ended[0]):
            rid = self._ended.popleft()
            self._apply("forget", r=rid)
            del self.requests[rid]
            self.stats.forgotten += 1

    # --------------------------------------------------------------- client calls
    def submit(self, prompt_ids: Iterable[int], max_new_tokens: int,
               eos_token_id: int | None = None, *, remote: bool = False,
               export: bool = False, sampler: Callable[[Any], int] | None = None,
               uncached: bool = False) -> int:
        """Queue a request; returns its id (see `AtomBatcher.submit`). `uncached`: it takes
        no prefix-cache hit, at admission or after a preemption (`Request.uncached`)."""
        try:  # integers only: int() would truncate 1.7 and parse "5"
            prompt = [as_token(t) for t in prompt_ids]
        except TypeError:
            raise ValueError("prompt token ids must be integers (not bool, float or str)") \
                from None
        vocab = self.vocab_size
        if not prompt:
            raise ValueError("empty prompt: give at least one token")
        if vocab is not None and not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt has token ids outside the vocabulary 0..{vocab - 1}")
        # integers as the prompt's ids are: numpy and torch integer scalars too (a count or an
        # eos read from an array), stored as int so they compare and serialise as one
        n_new = as_integer(max_new_tokens)
        if n_new is None or n_new < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        eos = None if eos_token_id is None else as_integer(eos_token_id)
        if eos_token_id is not None and eos is None:
            raise ValueError(f"eos_token_id must be a token id (int) or None, got "
                             f"{eos_token_id!r}")
        if eos is not None and vocab is not None and not 0 <= eos < vocab:
            # (never sampled: the request would run to max_new_tokens whatever it says)
            raise ValueError(f"eos_token_id {eos} is outside the vocabulary 0..{vocab - 1}: "
                             f"no token can end the request; pass the model's own end token")
        if sampler is not None and not callable(sampler):
            # else it would fail only at this request's first token, steps later
            raise ValueError(f"sampler must be a callable (logits [V] -> token id) or None, got "
                             f"{sampler!r}")
        s = self.config.max_seq_len
        if len(prompt) >= s:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens can never fit: max_seq_len={s} holds at most "
                f"{s - 1} prompt tokens plus the first generated one; shorten the prompt")
        if remote and export:
            raise ValueError("a request is either imported (remote) or exported, not both")
        if uncached and remote:
            raise ValueError("uncached: a remote request's prompt KV is imported, not computed "
                             "here")
        rid = self._next_id
        self._apply("submit", r=rid, p=seq(prompt))
        self._next_id += 1
        self.requests[rid] = Request(rid, prompt, n_new, eos, remote=remote, export=export,
                                     sampler=sampler, uncached=uncached, owner=self)
        self.waiting.append(rid)
        return rid

    def abort(self, request_id: int) -> bool:
        """End a request early; False (nothing changes) for an unknown or ended request."""
        req = self.requests.get(request_id)
        if req is None or req.ended:
            return False
        phase = self._m.phase.get(request_id)
        if phase == core.PHASE_WAITING:
            self.waiting.remove(request_id)
            self._apply("abort_waiting", r=request_id)
        else:  # a block in a transfer drains until its end is reported
            asked = self.awaits_kv(request_id)
            self._apply("abort_running", l=self._m.req_lane.get(request_id))
            if phase == core.PHASE_IMPORTING and not asked:
                # its table was still growing: nobody was asked for its KV, so no end of that
                # transfer will ever be reported; it ends here (nothing wrote the blocks)
                self._apply("transfer_end", r=request_id, b=self._draining(request_id))
        req.error = "aborted"
        self._ended_now(request_id)
        return True

    def finish(self, request_id: int) -> list[Event]:
        """End a decoding request as finished (not aborted): a stop the engine decided on a
        token this scheduler already emitted (a stop string, a stop id, a length cap of its
        own). Its blocks are filed in the prefix cache as any finish's. A request that is not
        decoding (waiting, in prefill, in a transfer) has no finished KV to file: it is aborted
        instead. Returns the events (none for an unknown or ended request). Between steps only:
        a request in the step's call would lose the call's outcome."""
        if self._loop is not None:
            raise RuntimeError("finish() while a step is in progress: update() it to its end")
        req = self.requests.get(request_id)
        if req is None or req.ended:
            return []
        if self._m.phase.get(request_id) != core.PHASE_DECODE:
            self.abort(request_id)
            return []
        events: list[Event] = []
        self._end(self._m.req_lane.get(request_id), events, None)
        return events

    def forget(self, request_id: int) -> bool:
        """Drop an ended request now; False, and nothing changes, for a request that has not
        ended or whose blocks still drain."""
        if request_id not in self.requests or not inplace.enabled_forget(self._m, r=request_id):
            return False
        self._apply("forget", r=request_id)
        del self.requests[request_id]
        if request_id in self._ended:  # (rare: callers that forget use keep_ended=None)
            self._ended.remove(request_id)
        self.stats.forgotten += 1
        return True

    # --------------------------------------------------------------- PD: the core's part
    def awaits_kv(self, request_id: int) -> bool:
        """The request's lane has its whole table and its "import" event went out."""
        s = self._m
        return (s.phase.get(request_id) == core.PHASE_IMPORTING
                and inplace.table_covers_prompt(s, s.req_lane.get(request_id)))

    def transfers(self) -> dict[int, int]:
        """Unfinished transfers: request -> the lowest-numbered block its transfer uses."""
        s, out = self._m, {}
        for b in range(s.consts.K):
            if s.transfer[b]:
                out.setdefault(s.transfer_req[b], b)
        return out

    def _draining(self, rid: int) -> int | None:
        """A block draining for rid's transfer (its end frees them all), or None."""
        s = self._m
        return next((b for b in range(s.consts.K)
                     if s.owner[b] == core.OWNER_DRAINING and s.transfer_req[b] == rid), None)

    def import_done(self, request_id: int, prompt: Sequence[int], first_token: int,
                    events: list[Event]) -> None:
        """The request's KV is written into its table: it decodes from `first_token` on."""
        p = seq(prompt)
        self._apply("import_done", r=request_id, p=p, tok=first_token)
        self.stats.imported_tokens += len(p)
        self._emit_token(self._m.req_lane.get(request_id), first_token, events)

    def export_done(self, request_id: int, events: list[Event]) -> None:
        self._apply("export_done", r=request_id, keep=self.config.prefix_cache)
        self.stats.exports += 1
        events.append(Event("finished", request_id))
        self._ended_now(request_id)

    def transfer_failed(self, rid: int, error: str, events: list[Event]) -> None:
        self._apply("transfer_fail", r=rid)
        self.stats.transfer_failures += 1
        self.requests[rid].error = error
        events.append(Event("error", rid, error=error))
        self._ended_now(rid)

    def stale_or_drained(self, rid: int) -> None:
        """An event for a request with no transfer: frees what drains for it, else is stale."""
        block = self._draining(rid)
        if block is not None:
            self._apply("transfer_end", r=rid, b=block)
            self._trim_ended()  # it may have held back older ones
        else:
            self.stats.stale_events += 1

    # --------------------------------------------------------------- checks and views
    def check_invariants(self) -> None:
        """The core's invariants, and that the block tables kept from its effects are the
        core's: each busy lane's blocks in token order."""
        s = self._m
        bad = inplace.check_invariants(s) + [
            f"index {ix} differs from its fields" for ix in inplace.check_indexes(s)]
        if not bad:
            for ln in range(s.consts.B):
                owned = sorted((s.start[b], b) for b in range(s.consts.K)
                               if s.owner[b] == core.OWNER_LANE and s.owner_lane[b] == ln)
                want = [b for _start, b in owned] if s.busy[ln] else []
                if self.tables[ln] != want:
                    bad.append(f"lane {ln}'s block table {self.tables[ln]} is not the core's "
                               f"{want}")
        if bad:
            raise InvariantViolation(bad)

    def describe(self) -> dict[str, Any]:
        s = self._m
        pins = self.policy.pinned(s)
        lanes = [{"lane": ln, "request": s.lane_req[ln] if s.busy[ln] else None,
                  "length": s.length[ln] if s.busy[ln] else 0, "blocks": list(self.tables[ln])}
                 for ln in range(s.consts.B)]
        owners = []
        for b in range(s.consts.K):
            own = core.OWNER_NAMES[s.owner[b]].lower()
            if own == "lane":
                own = f"lane:{s.owner_lane[b]}"
            elif b in pins:
                own = "pinned"
            owners.append(own)
        cache = [{"block": b, "tokens": len(s.key[b]), "last_use": self.policy.last_use.get(b, 0)}
                 for b in range(s.consts.K) if s.owner[b] == core.OWNER_CACHE]
        host = [{"slot": h, "state": core.SLOTSTATE_NAMES[s.slot_state[h]].lower(),
                 "tokens": len(s.slot_key[h])} for h in range(s.consts.H)]
        return {"lanes": lanes, "blocks": owners, "cache": cache, "host_cache": host,
                "waiting": list(self.waiting), "stats": attrs.asdict(self.stats)}

    # --------------------------------------------------------------- core plumbing
    def transition(self, action: str, args: dict[str, Any]) -> core.Step:
        """The core's transition `action(**args)` on the live state, every step's one way
        in: the step's state is the live state afterwards. A subclass may take it elsewhere
        (the test machine: through its checks, on its own core; testing/machine/scheduled.py);
        the scheduler's bookkeeping of the step (tables, policy, listeners) stays here."""
        return inplace.ACTIONS[action][0](self._m, **args)

    def restore(self, state: core.State) -> None:
        """Make `state` the live core state (a copy: `state` stays as it is), its block
        tables read from it; for a driver that moved the core elsewhere (the test machine's
        direct actions). Between steps only."""
        self._m = inplace.thaw(state)
        self.version += 1
        s, t = self._m, self.config.blocks_per_table
        for ln in range(s.consts.B):
            owned = sorted((s.start[b], b) for b in range(s.consts.K)
                           if s.owner[b] == core.OWNER_LANE and s.owner_lane[b] == ln)
            table = [b for _start, b in owned] if s.busy[ln] else []
            self.tables[ln] = table
            self._rows[ln] = (*table, *table[-1:] * (t - len(table))) if table else (0,) * t

    def _apply(self, action: str, **args: Any) -> core.Step:
        step = self.transition(action, args)
        if step.rejected is not None:
            raise CoreRejected(f"{action}({args}) rejected by guard {step.rejected}")
        self._m = step.state
        self.version += 1
        self.policy.observe(step.effects)
        t = self._t
        for eff in step.effects:
            if not isinstance(eff, _TABLE_EFFECTS):  # (a decode's: the tables stay)
                continue
            if isinstance(eff, (core.Admit, core.Inbound)):
                self.tables[eff.lane] = [eff.block]
                self._rows[eff.lane] = (eff.block,) * t
            elif isinstance(eff, core.Grow):
                table = self.tables[eff.lane]
                assert eff.pos == len(table), (eff, table)
                table.append(eff.block)
                self._rows[eff.lane] = (*table, *(eff.block,) * (t - len(table)))
            elif isinstance(eff, (core.Release, core.Preempt)):
                self.tables[eff.lane] = []
        for listener in self.listeners:
            listener(step.effects)
        if self._trace is not None:
            self._trace.write(json.dumps(record(action, args, step.effects)) + "\n")
        return step
