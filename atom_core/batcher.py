"""AtomBatcher: the executor between the scheduler (`atom_core/scheduler/`) and a runtime.

The scheduler holds the core state, the policy and the scheduling loop, and says, as plain
data, what each step needs done: block work (a prefix hit's copy, a host-tier store or load, a
hybrid snapshot) and the forward call (one prefill chunk or one decode over every row). This
module turns that into runtime calls and tensors, turns logits into tokens (argmax or the
request's sampler), keeps the host buffers (host-tier slots, hybrid snapshots) and reports the
outcomes back. It decides nothing: every guard and update lives in the core generated from the
spec, every choice is the policy's, and every transition is the scheduler's.

One prefill per step (a prefix-hit copy first, then only the chunks not yet computed), the
earliest admitted prefilling lane's, otherwise one decode call over every row; decoding lanes
wait for at most `Policy.max_decode_wait` prefill calls in a row (`Policy.prefill_first`).
A runtime without static shapes says so (`protocol.py`): with `static_batch` False a decode
call gets the live rows only, and with `mixed_calls` a step runs the decode beside prompt
chunks of several lanes in one call (`runtime.mixed`, the scheduler's `MixedCall`).
A runtime error fails the requests it touched and nothing else: the batcher keeps serving.

Prefill/decode disaggregation (PD): a request submitted with `remote=True` is admitted into a
lane whose block waits for KV computed by a prefill worker (`import_kv` delivers it,
`transfer_ended` reports a transfer that ended without it); one submitted with `export=True` is
prefilled and then handed out (`take_export`, `export_done`) instead of decoded. While a
transfer is in flight the other lanes keep decoding. Which blocks a transfer uses, and when they
may be freed, is the core's business: an importing lane's table grows (`import_grow`) until it
covers the prompt, and only then is the transfer asked for (the "import" event); an abort
during a transfer leaves its blocks draining until the transfer's end is reported. The PD calls
are `atom_core/pd/endpoint.py`'s (`PDEndpoint`, mixed in here).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

import attrs
import torch

from atom_core._generated import core, inplace
from atom_core.config import HOST_KV_REFUSAL, LOCAL_COPY_REFUSAL, Config
from atom_core.pd.endpoint import Export, PDEndpoint, all_finite
from atom_core.policy import Policy
from atom_core.runtime.protocol import Capabilities, capabilities
from atom_core.scheduler import (
    CopyWork,
    CoreRejected,
    DecodeCall,
    Event,
    InvariantViolation,
    LoadWork,
    MixedCall,
    PrefillCall,
    Request,
    Result,
    Scheduler,
    SnapshotWork,
    Stats,
    StepOutput,
    StepResult,
    StoreWork,
    Work,
    as_integer,
    as_token,
)
from atom_core.snapshots import SnapshotStore

# (the types callers import from here since before the scheduler had a module of its own)
__all__ = ["AtomBatcher", "CoreRejected", "Event", "Export", "InvariantViolation", "Plan",
           "Request", "Result", "Stats", "all_finite", "check_runtime"]


@attrs.frozen(eq=False)
class Plan:
    """One step's runtime call, as `AtomBatcher.plan()` chose it: `call` is "prefill",
    "decode", "mixed" (a runtime with `mixed_calls`: `parts` holds the decode's plan or None
    and the prefills' plans, each made as for a call of its own; `args()` is (the decode's
    arguments or None, [each prefill's arguments])) or None (nothing to compute this step:
    `complete()` with no outputs). The inputs
    are the runtime's (`args()` in its order): token ids, positions, block tables (a prefill's
    one row, or decode's [B, T] with each padding row at its padding target), the local block
    tables of a hybrid model (else None) and, for a prefill, the index of the chunk's last
    token. `lanes` are the lanes computing (a prefill's one lane, or decode's live rows),
    `padding` decode's padding rows. `events` are those of the choices made so far (admissions,
    growth, preemptions); `complete()` returns them first. `effect` is the core's plan for the
    call (a `core.Prefill` or `core.Decode`), `pad` and `lpad` decode's padding targets;
    `scheduled` the scheduler's call the tensors were made from (a `PrefillCall`, a
    `DecodeCall` or a `MixedCall`). `rows`: the lanes decode's tensors hold, in order, when
    the runtime computes live rows only (`static_batch` False: the padding rows are not
    passed, and its logits have one row per entry); None: every row 0..B-1."""

    call: str | None
    events: tuple[Event, ...]
    ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    tables: torch.Tensor | None = None
    local: torch.Tensor | None = None
    last: torch.Tensor | None = None
    lanes: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    effect: Any = None
    pad: int = 0
    lpad: int = 0
    scheduled: PrefillCall | DecodeCall | MixedCall | None = None
    rows: tuple[int, ...] | None = None
    parts: tuple[Plan | None, tuple[Plan, ...]] | None = None
    # a prefill whose request wants its prompt's logits (`Request.prompt_logits`): the runtime
    # returns every real token's (its `prompt_logits` capability)
    all_logits: bool = False

    def kwargs(self) -> dict[str, Any]:
        """The runtime call's keyword arguments: `all_logits` when a prefill wants every
        position's logits (never passed otherwise: a runtime without the capability never sees
        it)."""
        if self.call == "prefill" and self.all_logits:
            return {"all_logits": True}
        if self.call == "mixed" and self.parts is not None \
                and any(p.all_logits for p in self.parts[1]):
            return {"all_logits": tuple(p.all_logits for p in self.parts[1])}
        return {}

    def args(self) -> tuple[Any, ...]:
        """The runtime call's positional arguments."""
        if self.call == "mixed":
            assert self.parts is not None
            d, ps = self.parts
            return (None if d is None else d.args(), [p.args() for p in ps])
        if self.call == "prefill":
            return (self.ids, self.positions, self.tables, self.local, self.last)
        return (self.ids, self.positions, self.tables, self.local)


def check_runtime(cfg: Config, rt: Any) -> Capabilities:
    """The runtime's capabilities (`protocol.capabilities`: RuntimeProtocolError if it is no
    runtime), which must be those of the artifact the config describes."""
    caps = capabilities(rt)
    wrong = [f"{name}: config {want}, runtime {got}"
             for name, want, got in (("num_blocks", cfg.kv_blocks, caps.num_blocks),
                                     ("block_size", cfg.block_size, caps.block_size),
                                     ("max_seq_len", cfg.max_seq_len, caps.max_seq_len),
                                     ("prefill_chunk", cfg.prefill_chunk, caps.prefill_chunk))
             if got != want]
    hybrid = caps.hybrid
    if hybrid != (cfg.sliding_window is not None):
        wrong.append(f"sliding_window: config {cfg.sliding_window}, runtime "
                     + ("has sliding-window layers" if hybrid else "has none"))
    elif caps.sliding_window is not None and caps.sliding_window != cfg.sliding_window:
        wrong.append(f"sliding_window: config {cfg.sliding_window}, runtime "
                     f"{caps.sliding_window}")
    if cfg.host_cache_blocks and not caps.host_kv_trusted:
        # a runtime whose block transfers to and from the host are not yet trusted (RBLN)
        wrong.append(f"host_cache_blocks: {HOST_KV_REFUSAL}")
    elif cfg.host_cache_blocks and not caps.host_ops:
        wrong.append("host_cache_blocks: the host tier stores and loads blocks through host "
                     "buffers (new_host_buffer/fetch_kv_cache/update_kv_cache), which this "
                     "runtime lacks; set host_cache_blocks=0")
    if hybrid and cfg.prefix_cache and not caps.local_ops:
        wrong.append(f"prefix_cache: {LOCAL_COPY_REFUSAL}")
    if cfg.lanes not in caps.decoder_batch_sizes:
        wrong.append(f"lanes: config {cfg.lanes}, runtime decode graphs "
                     f"{list(caps.decoder_batch_sizes)}")
    if wrong:
        raise ValueError("the runtime does not match the config (" + "; ".join(wrong)
                         + "): build the Config from the compiled artifact's settings")
    return caps


class AtomBatcher(PDEndpoint):
    def __init__(self, config: Config, runtime: Any, *, policy: Policy | None = None,
                 ghost: bool = False, trace: IO[str] | None = None,
                 keep_ended: int | None = 10_000) -> None:
        """`keep_ended`: how many ended requests keep their `requests` entry (tokens, error)
        for the caller to read; older ones are forgotten (the core's `forget`), so memory does
        not grow with the requests served. None keeps every one."""
        self.config, self.runtime = config, runtime
        # the runtime's capabilities, read once (protocol.py): without the optional ones,
        # RBLN's static shapes
        self.capabilities = caps = check_runtime(config, runtime)
        self._live_rows = not caps.static_batch
        self.scheduler = Scheduler(config, policy=policy, ghost=ghost, trace=trace,
                                   keep_ended=keep_ended, vocab_size=caps.vocab_size,
                                   mixed=caps.mixed_calls,
                                   prefill_tokens=caps.mixed_prefill_tokens)
        self._hybrid = config.sliding_window is not None
        # hybrid prefix cache: host copies of sliding-window state at chunk boundaries, moved
        # along the core's effects (`_move_snapshots`)
        self._snaps = SnapshotStore() if self._hybrid and config.prefix_cache else None
        self._fetched: Any = None  # the snapshot buffer of the last SnapshotWork, until applied
        if self._snaps is not None:
            self.scheduler.listeners.append(self._move_snapshots)
        self._host: dict[int, Any] = {}  # host tier: slot -> its host buffer (made on first use)
        self._import_ref: tuple[Any, ...] | None = None
        # the pending plan (between plan() and complete()) and the state version it was made in
        self._plan: Plan | None = None
        self._planned = -1

    # --------------------------------------------------------------- views of the scheduler
    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    @property
    def requests(self) -> dict[int, Request]:  # type: ignore[override]
        return self.scheduler.requests

    @property
    def waiting(self) -> deque[int]:
        """The waiting requests in admission order (the scheduler's queue itself)."""
        return self.scheduler.waiting

    @property
    def stats(self) -> Stats:
        return self.scheduler.stats

    @property
    def keep_ended(self) -> int | None:
        return self.scheduler.keep_ended

    @property
    def _tables(self) -> list[list[int]]:
        return self.scheduler.tables

    @property
    def _version(self) -> int:
        return self.scheduler.version

    @property
    def _frozen(self) -> Any:
        return self.scheduler._frozen

    @_frozen.setter
    def _frozen(self, value: Any) -> None:
        self.scheduler._frozen = value

    def _apply(self, action: str, **args: Any) -> core.Step:
        """Apply one transition directly (tests and tools; the step's own go through the
        scheduler)."""
        return self.scheduler._apply(action, **args)

    @property
    def state(self) -> core.State:
        """The core state, frozen (a `core.State`: immutable, compared and hashed by value).
        A copy made on the first read after a transition and kept until the next one, so two
        reads with nothing in between give the same object. For tests, tools and views; a hot
        path reads `view`."""
        return self.scheduler.state

    @property
    def view(self) -> inplace.MState:
        """The core state itself (the in-place core's `MState`: the fields of `core.State` as
        lists and dicts), live: it changes with every transition. Read it, never write it, and
        only from the thread that drives the batcher."""
        return self.scheduler.view

    def phase(self, request_id: int) -> int:
        """The core's phase of a request (`core.PHASE_*`; `PHASE_NONE` for one it does not
        know or has forgotten)."""
        return self.scheduler.phase(request_id)

    # --------------------------------------------------------------- client API
    def submit(self, prompt_ids: Iterable[int], max_new_tokens: int,
               eos_token_id: int | None = None, *, remote: bool = False,
               export: bool = False,
               sampler: Callable[[torch.Tensor], int] | None = None,
               prompt_logits: Callable[[int, torch.Tensor], None] | None = None) -> int:
        """Queue a request; returns its id. `remote`: its prompt's KV comes from a prefill worker
        (see `import_kv`). `export`: prefill it and hand its KV out (see `take_export`).
        `sampler`: called with the logits [V] of each token this request generates here, returns
        the token (host-side sampling; called once per token, in order, so a seeded sampler
        repeats); None: greedy. `prompt_logits`: called with (start, logits [n, V]) of each
        prompt chunk computed for it (`Request.prompt_logits`; the runtime's `prompt_logits`
        capability), before the chunk's token is reported; such a request takes no prefix hit."""
        if prompt_logits is not None:
            if not self.capabilities.prompt_logits:
                raise ValueError(
                    "prompt_logits: this runtime returns a prefill's last position's logits only "
                    "(it lacks the prompt_logits capability, as RBLN's compiled prefill graph "
                    "does), so a prompt's logits at every position cannot be had")
            if remote or export:
                raise ValueError("prompt_logits: only for a request prefilled here (not remote "
                                 "or export)")
        planned = self._plan is not None and self._version == self._planned
        rid = self.scheduler.submit(prompt_ids, max_new_tokens, eos_token_id, remote=remote,
                                    export=export, sampler=sampler,
                                    uncached=prompt_logits is not None)
        if prompt_logits is not None:
            self.requests[rid].prompt_logits = prompt_logits
        if planned:  # a new waiting request changes nothing a pending plan chose
            self._planned = self._version
        return rid

    def abort(self, request_id: int) -> bool:
        """End a request early. False (and nothing changes) for an unknown or ended request.
        Not while a plan is pending (between `plan()` and `complete()`): a RuntimeError, and
        nothing changes; abort after `complete()`."""
        rid = as_integer(request_id)
        if rid is None:
            # 1.0 == 1 as a dict key: a float would abort request 1
            raise ValueError(f"request ids are integers (from submit), got {request_id!r}")
        self._no_pending_plan("abort")
        return self.scheduler.abort(rid)

    def forget(self, request_id: int) -> bool:
        """Drop an ended request now (its `requests` entry and the core's record of it). False,
        and nothing changes, for a request that has not ended or whose blocks still drain."""
        planned = self._plan is not None and self._version == self._planned
        if not self.scheduler.forget(request_id):
            return False
        if planned:  # an ended request holds nothing a pending plan chose (as submit)
            self._planned = self._version
        return True

    def _no_pending_plan(self, call: str) -> None:
        """Refuse a call that changes lanes or blocks while a plan is pending. The planned
        runtime call may already have run: complete() would then have to refuse the step, and
        the next step would run it again, which a plain model survives (the same KV written
        twice) but a hybrid model does not (each call appends to its rows' sliding windows, so
        every other decoding request's window would hold a position twice); the plan's events
        (preemptions, "import", a failed copy's error) would be lost with it."""
        if self._plan is not None:
            raise RuntimeError(
                f"{call}() while a plan is pending (between plan() and complete()): nothing "
                f"changed; call complete() with the planned call's outputs first, then {call}()")

    def busy(self) -> bool:
        return self.scheduler.busy()

    # --------------------------------------------------------------- the step
    def step(self) -> list[Event]:
        """One step: `plan()`, the runtime call it names, `complete()`."""
        plan = self.plan()
        if plan.call is None:
            return self.complete()
        try:
            out = getattr(self.runtime, plan.call)(*plan.args(), **plan.kwargs())
        except Exception as exc:  # noqa: BLE001 - fails the requests the call touched
            return self.complete(error=exc)
        except BaseException as exc:
            # KeyboardInterrupt, SystemExit inside the call: its requests fail as for an error
            # (the plan must not stay pending, else every later plan() refuses), then it goes on
            self.complete(error=exc)
            raise
        return self.complete(out)

    def plan(self) -> Plan:
        """The core's choices for this step, up to its runtime call: lanes get their next
        blocks, waiting requests are admitted (copies and loads of prefix hits run here), and
        one prefill or one decode call over every lane is planned. Run that call (or have an
        engine run it) and pass its logits to `complete()`; nothing else may change the
        batcher in between but `submit` and `forget` (abort and the PD calls that change
        lanes or blocks refuse, with nothing changed: call them before `plan()` or after
        `complete()`)."""
        if self._plan is not None:
            raise RuntimeError("plan() called while a plan is pending: call complete() first")
        out = self._run_work(self.scheduler.schedule())
        if out.call is None:
            plan = Plan(None, out.events)
        elif isinstance(out.call, PrefillCall):
            plan = self._prefill_plan(out.call, out.events)
        elif isinstance(out.call, MixedCall):
            plan = self._mixed_plan(out.call, out.events)
        else:
            plan = self._decode_plan(out.call, out.events)
        self._plan, self._planned = plan, self._version
        return plan

    def complete(self, logits: Any = None, *, tokens: Sequence[int] | None = None,
                 error: BaseException | None = None) -> list[Event]:
        """End the planned step: `logits` are the planned call's output ([1, 1, V] for a
        prefill, or the whole chunk's [1, c, V], read at the chunk's last real token; [B, 1, V]
        for decode, [len(plan.rows), 1, V] when it computed the live rows only; a mixed call's
        pair (`_mixed_result`); none when the plan has no call), or `tokens` the tokens an
        engine sampled from them (one for a prefill, read only for the prompt's last chunk;
        one per computed row for decode, padding rows' ignored; the requests' own samplers
        are then not called, and a token that is not an id in the vocabulary fails its request
        alone), or `error` the
        exception the call raised (it fails the requests the call touched, nothing else).
        Logits of another shape fail the call's requests; a row whose logits are not finite
        (NaN, inf) fails its request alone. Returns the step's events, the plan's first."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("complete() called without a pending plan: call plan() first "
                               "(once per complete())")
        self._plan = None
        if self._version != self._planned:
            self.scheduler.abandon()
            raise RuntimeError("the batcher changed between plan() and complete() (abort or a "
                               "PD call): its plan no longer holds")
        if plan.call is None:
            return list(plan.events)
        if plan.call == "prefill":
            result = self._prefill_result(plan, logits, tokens, error)
        elif plan.call == "mixed":
            result = self._mixed_result(plan, logits, tokens, error)
        else:
            result = self._decode_result(plan, logits, tokens, error)
        return list(self._run_work(self.scheduler.update(result)).events)

    def run_until_done(self, max_steps: int | None = None) -> dict[int, Result]:
        """Step until nothing waits, runs or transfers. With PD, transfers end only when the
        caller reports them (`import_kv`, `transfer_ended`, `export_done`): drive PD batchers
        through a worker (atom_core/pd/workers.py), or pass `max_steps`."""
        steps = 0
        while self.busy():
            self.step()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                raise RuntimeError(f"not done after {max_steps} steps")
        return {rid: Result(list(r.tokens), r.error) for rid, r in self.requests.items()}

    # --------------------------------------------------------------- block work
    def _run_work(self, out: StepOutput) -> StepOutput:
        """Run the block work the scheduler asks for, reporting each outcome, until it asks
        for the call or the step ends."""
        while out.work:
            out = self.scheduler.update(StepResult(work=tuple(map(self._work, out.work))))
        return out

    def _work(self, work: Work) -> str | None:
        """Run one item of block work; None when done, else why it failed (a failed copy's
        text is its request's error)."""
        if isinstance(work, CopyWork):
            try:
                self.runtime.copy_kv_cache(work.src, work.dst, work.n)
            except Exception as exc:  # noqa: BLE001 - any runtime failure fails this one
                return f"copy_kv_cache failed: {exc!r}"
            if self._snaps is not None:  # the hit's sliding state (spec: copy_done)
                try:
                    self.runtime.update_local_cache(
                        self._snaps.restore_source(work.src, work.length), work.lane)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    return f"update_local_cache failed: {exc!r}"
            return None
        if isinstance(work, StoreWork):
            try:  # the allocation too: host memory can run out, and the store must still end
                if work.slot not in self._host:
                    self._host[work.slot] = self.runtime.new_host_buffer()
                self.runtime.fetch_kv_cache(self._host[work.slot], work.block)
            except Exception as exc:  # noqa: BLE001 - only this entry is lost
                return f"fetch_kv_cache failed: {exc!r}"
            return None
        if isinstance(work, LoadWork):
            try:
                self.runtime.update_kv_cache(self._host[work.slot], work.dst)
            except Exception as exc:  # noqa: BLE001 - the request recomputes
                return f"update_kv_cache failed: {exc!r}"
            return None
        assert isinstance(work, SnapshotWork)
        try:  # allocation included: a snapshot is an optimisation, never worth a request
            host = self.runtime.new_local_host_buffer()
            self.runtime.fetch_local_cache(host, work.lane)
        except Exception as exc:  # noqa: BLE001 - a read: the lane's state is intact
            return f"fetch_local_cache failed: {exc!r}"
        self._fetched = host
        return None

    def _move_snapshots(self, effects: Sequence[Any]) -> None:
        """The hybrid prefix cache's host buffers follow the core's effects (a listener of the
        scheduler's transitions)."""
        snaps = self._snaps
        assert snaps is not None
        tables = self.scheduler.tables
        for eff in effects:
            if isinstance(eff, (core.Admit, core.Inbound)):
                snaps.admitted(eff.lane, None)
            elif isinstance(eff, core.Grow):  # (before a grow_hit's Copy: the lane's own)
                snaps.filled(eff.lane, tables[eff.lane][eff.pos - 1])
            elif isinstance(eff, core.Copy):
                snaps.admitted(eff.lane, eff.src)
            elif isinstance(eff, core.Release):
                snaps.released(eff.lane, eff.block)
        snaps.sync(self.scheduler.view)
        for eff in effects:
            if isinstance(eff, core.Snapshot):
                snaps.taken(eff.lane, eff.n, self._fetched)
                self._fetched = None

    # --------------------------------------------------------------- the call
    def _prefill_plan(self, call: PrefillCall, events: tuple[Event, ...]) -> Plan:
        c = self.config.prefill_chunk
        ids = torch.zeros((1, c), dtype=torch.int64)
        ids[0, :len(call.ids)] = torch.tensor(call.ids, dtype=torch.int64)
        pos = torch.arange(call.start, call.start + c, dtype=torch.int32).unsqueeze(0)
        local = None if call.local is None else torch.tensor([call.local], dtype=torch.int16)
        req = self.requests.get(call.request)
        return Plan("prefill", events, ids, pos, torch.tensor(call.table, dtype=torch.int16),
                    local, torch.tensor(len(call.ids) - 1, dtype=torch.int16),
                    lanes=(call.lane,), effect=call.effect, scheduled=call,
                    all_logits=req is not None and req.prompt_logits is not None)

    def _decode_plan(self, call: DecodeCall, events: tuple[Event, ...]) -> Plan:
        # a runtime without static shapes computes the live rows only (the padding rows'
        # writes, which the core allows at the padding target, are simply not made)
        rows = call.lanes if self._live_rows else None

        def pick(xs: Sequence[Any]) -> Sequence[Any]:
            return xs if rows is None else [xs[ln] for ln in rows]

        ids = torch.tensor(pick(call.ids), dtype=torch.int64).unsqueeze(1)
        pos = torch.tensor(pick(call.positions), dtype=torch.int32).unsqueeze(1)
        tables = torch.tensor(pick(call.tables), dtype=torch.int16)
        local = None if call.local is None \
            else torch.tensor(pick(call.local), dtype=torch.int16).unsqueeze(1)
        return Plan("decode", events, ids, pos, tables, local, lanes=call.lanes,
                    padding=call.padding, effect=call.effect, pad=call.pad, lpad=call.lpad,
                    scheduled=call, rows=rows)

    def _mixed_plan(self, call: MixedCall, events: tuple[Event, ...]) -> Plan:
        """A decode (if a lane decodes) and prompt chunks in one runtime call (`mixed`)."""
        d = None if call.decode is None else self._decode_plan(call.decode, ())
        ps = tuple(self._prefill_plan(pc, ()) for pc in call.prefills)
        lanes = (d.lanes if d is not None else ()) + tuple(pc.lane for pc in call.prefills)
        return Plan("mixed", events, lanes=lanes, scheduled=call, parts=(d, ps))

    def _logit_rows(self, logits: Any, rows: int, last: int | None) -> torch.Tensor:
        """The planned call's logits as [rows, V]: each computed row's last position; for a
        prefill given the whole chunk's logits [1, C, V] (`complete` takes them) or its real
        tokens' [1, last + 1, V] (`all_logits`), the chunk's last real token (`last`), not
        position C - 1, which a short last chunk only pads.
        Anything else raises, naming the shape: a [1, V] prefill output would otherwise read as
        one scalar (argmax 0) and a decode output with too few rows would break the step;
        logits wider than the runtime's vocabulary would sample a token the next call cannot
        embed, failing every lane."""
        c, vocab = self.config.prefill_chunk, self.capabilities.vocab_size
        want = (f"[1, 1 or {last + 1} or C={c}, V={vocab}]" if last is not None
                else f"[B={rows}, 1, V={vocab}]")
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits must be a torch.Tensor {want}, got {type(logits).__name__}")
        shape = tuple(logits.shape)
        if len(shape) != 3 or shape[0] != rows or shape[1] < 1 or shape[2] < 1 \
                or vocab is not None and shape[2] != vocab \
                or last is not None and shape[1] not in (1, last + 1, c):
            raise ValueError(f"logits have shape {list(shape)}, the planned call's are {want}")
        if last is None:
            return logits[:, -1, :]
        return logits[:, 0 if shape[1] == 1 else last, :]

    @staticmethod
    def _greedy(rows: torch.Tensor) -> tuple[list[int], list[bool]]:
        """Each row's argmax (ties to the lowest id) and whether its logit is finite. max
        propagates NaN, so a row with any NaN, a +inf logit or only -inf ones is not finite:
        a device fault whose token would be served as if the model had chosen it."""
        best, toks = rows.max(dim=-1)  # (one op for both: 10 us per step against 16 at B = 32)
        return toks.tolist(), torch.isfinite(best).tolist()

    def _prefill_result(self, plan: Plan, logits: Any, tokens: Sequence[int] | None,
                        error: BaseException | None) -> StepResult:
        """The prefill's outcome for the scheduler: its token, or why its request fails."""
        call = plan.scheduled
        assert isinstance(call, PrefillCall)
        tok, row = 0, None
        if error is None and tokens is None:
            try:
                row = self._logit_rows(logits, 1, int(plan.last))  # type: ignore[arg-type]
                (tok,), (finite,) = self._greedy(row)
                if not finite:
                    raise ValueError(f"the logits are not finite (NaN or inf; row max "
                                     f"{float(row[0, tok])})")
            except Exception as exc:  # noqa: BLE001 - logits the call got wrong
                error = exc
        if error is not None:
            return StepResult(error=repr(error))
        if plan.all_logits and tokens is None:
            # (before the chunk's token is reported: whoever reads the token has its prompt's)
            try:
                self._prompt_logits(call, logits)
            except Exception as exc:  # noqa: BLE001 - this request's, nothing else
                return StepResult(row_errors=(f"prompt logits failed: {exc!r}",))
        if tokens is not None and call.emits:
            # (a chunk that emits nothing never reads its token: an engine need not sample it)
            try:
                (tok,) = tokens
                tok = self._checked(tok)
            except Exception as exc:  # noqa: BLE001 - this request's token, nothing else
                return StepResult(row_errors=(f"token rejected: {exc!r}",))
        elif tokens is None and call.emits:
            req = self.requests[call.request]
            if req.sampler is not None:
                assert row is not None
                try:
                    tok = self._sample(req, row[0])
                except Exception as exc:  # noqa: BLE001 - this request's sampler, nothing else
                    return StepResult(row_errors=(f"sampler failed: {exc!r}",))
        return StepResult(tokens=(tok,), row_errors=(None,))

    def _prompt_logits(self, call: PrefillCall, logits: torch.Tensor) -> None:
        """Hand a prefill's logits of each real token to its request's `prompt_logits`."""
        n = len(call.ids)
        if logits.shape[1] < n:
            raise ValueError(f"the runtime returned {logits.shape[1]} position(s) of logits for "
                             f"a chunk of {n} tokens whose every position was asked for")
        self.requests[call.request].prompt_logits(call.start,  # type: ignore[misc]
                                                  logits[0, :n])

    def _decode_result(self, plan: Plan, logits: Any, tokens: Sequence[int] | None,
                       error: BaseException | None) -> StepResult:
        """The decode call's outcome for the scheduler: a token per row, and each row's own
        failure (its sampler, its token, its logits not finite), or the call's."""
        call = plan.scheduled
        assert isinstance(call, DecodeCall)
        b = self.config.lanes
        # the call's rows: every row, or (live rows only) the live lanes in order
        computed = plan.rows if plan.rows is not None else range(b)
        n = len(computed)
        rows, finite = None, None
        if error is None:
            try:
                if tokens is None:
                    rows = self._logit_rows(logits, n, None)
                    got, finite = self._greedy(rows)
                elif len(tokens) != n:
                    raise ValueError(f"{len(tokens)} tokens for {n} rows")
                else:
                    got = list(tokens)
            except Exception as exc:  # noqa: BLE001 - outputs the call got wrong
                error = exc
        if error is not None:
            return StepResult(error=repr(error))
        at = {ln: i for i, ln in enumerate(computed)}  # lane -> its row of the call
        toks: list[Any] = [0] * b
        for ln, i in at.items():
            toks[ln] = got[i]
        # a request's own sampler failing fails that request alone, after the step (its row's
        # KV was written like every other row's)
        bad: list[str | None] = [None] * b
        for ln, rid in enumerate(call.requests):
            if rid is None:  # a padding row
                if tokens is not None:
                    toks[ln] = 0  # (the engine's for a padding row: never used, maybe None)
                continue
            req = self.requests[rid]
            if tokens is not None:
                try:
                    toks[ln] = self._checked(toks[ln])
                except Exception as exc:  # noqa: BLE001
                    bad[ln], toks[ln] = f"token rejected: {exc!r}", 0
            elif finite is not None and not finite[at[ln]]:
                # this row's logits only: the rows are independent, the others are served
                assert rows is not None
                bad[ln] = (f"decode failed: the logits are not finite (NaN or inf; row max "
                           f"{float(rows[at[ln], toks[ln]])})")
                toks[ln] = 0
            elif req.sampler is not None:
                assert rows is not None
                try:
                    toks[ln] = self._sample(req, rows[at[ln]])
                except Exception as exc:  # noqa: BLE001
                    bad[ln] = f"sampler failed: {exc!r}"
        return StepResult(tokens=tuple(int(t) for t in toks), row_errors=tuple(bad))

    def _mixed_result(self, plan: Plan, logits: Any, tokens: Sequence[int] | None,
                      error: BaseException | None) -> StepResult:
        """A mixed call's outcome: the decode's B rows, then one per prefill. `logits` are the
        runtime's (the decode's logits or None, the prefills' [P, 1, V]); `tokens` an engine's:
        the decode's computed rows, then one per prefill. A prefill whose logits are not
        finite fails its request alone, as a decode row does."""
        assert plan.parts is not None
        d, ps = plan.parts
        rows = 0 if d is None else len(d.rows if d.rows is not None else range(self.config.lanes))
        dl: Any = None
        pl: list[Any] = [None] * len(ps)
        dt: Sequence[int] | None = None
        pt: list[Sequence[int] | None] = [None] * len(ps)
        if error is None:
            try:
                if tokens is not None:
                    if len(tokens) != rows + len(ps):
                        raise ValueError(f"{len(tokens)} tokens for a mixed call of {rows} "
                                         f"decode rows and {len(ps)} prefills")
                    dt = tokens[:rows]
                    pt = [tokens[rows + i:rows + i + 1] for i in range(len(ps))]
                else:
                    dl, both = logits
                    # (a list: one tensor per prefill, when some want every position's logits)
                    listed = isinstance(both, (list, tuple))
                    if not (listed or isinstance(both, torch.Tensor)) \
                            or len(both) != len(ps) or (d is None) != (dl is None):
                        raise ValueError(f"a mixed call's logits must be (the decode's or None, "
                                         f"[P={len(ps)}, 1, V] or P tensors [1, n, V])")
                    pl = list(both) if listed else [both[i:i + 1] for i in range(len(ps))]
            except Exception as exc:  # noqa: BLE001 - outputs the call got wrong
                error = exc
        if error is not None:
            return StepResult(error=repr(error))
        out_toks: list[int] = []
        out_errs: list[str | None] = []
        if d is not None:
            r = self._decode_result(d, dl, dt, None)
            if r.error is not None:
                return r
            out_toks += r.tokens
            out_errs += r.row_errors
        for p, lg, tk in zip(ps, pl, pt, strict=True):
            r = self._prefill_result(p, lg, tk, None)
            out_toks.append(r.tokens[0] if r.tokens else 0)
            out_errs.append(f"prefill failed: {r.error}" if r.error is not None
                            else (r.row_errors[0] if r.row_errors else None))
        return StepResult(tokens=tuple(out_toks), row_errors=tuple(out_errs))

    def _checked(self, tok: Any) -> int:
        """A token an engine sampled: an id in the vocabulary (else the next decode call
        would fail for every lane)."""
        tok = as_token(tok)
        vocab = self.capabilities.vocab_size
        if tok < 0 or vocab is not None and tok >= vocab:
            raise ValueError(f"token {tok} outside the vocabulary")
        return tok

    def _sample(self, req: Request, logits: Any) -> int:
        """The request's sampler's token, checked: a token outside the vocabulary would fail
        the next decode call for every lane."""
        tok = as_token(req.sampler(logits))  # type: ignore[misc]
        vocab = logits.shape[-1]
        if not 0 <= tok < vocab:
            raise ValueError(f"token {tok} outside the vocabulary 0..{vocab - 1}")
        return tok

    # --------------------------------------------------------------- checks and views
    def check_invariants(self) -> None:
        """The core's invariants, and that the block tables kept from its effects (what the
        runtime is given) are the core's: each busy lane's blocks in token order."""
        self.scheduler.check_invariants()

    def describe(self) -> dict[str, Any]:
        out = self.scheduler.describe()
        # host memory the adapter holds for the core's snapshots (each one a local slot)
        out["snapshots"] = ({"lanes": {ln: sorted(v) for ln, v in self._snaps.lanes.items()},
                             "entries": {b: sorted(v) for b, v in self._snaps.entries.items()}}
                            if self._snaps is not None else None)
        return {k: out[k] for k in ("lanes", "blocks", "cache", "host_cache", "snapshots",
                                    "waiting", "stats")}
