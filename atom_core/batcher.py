"""AtomBatcher: the thin imperative adapter between the verified core and a runtime.

It holds the core state, asks the policy for choices, applies core transitions and executes
their effects on the runtime. It decides nothing the spec decides: every guard and update lives
in the core generated from the spec; what a runtime call touches comes from the transition's
effects (`*_plan` gives them before the call, for calls whose result the transition needs).
The state is the in-place core's (`atom_core/_generated/inplace.py`: the same guards, updates
and effects as `core.py`, applied to one mutable state instead of building a new immutable one
per transition); `state` offers it frozen, as a `core.State`.

One prefill per step (a prefix-hit copy first, then only the chunks not yet computed), the
earliest admitted prefilling lane's, otherwise one decode call over every row; decoding lanes
wait for at most `Policy.max_decode_wait` prefill calls in a row (`Policy.prefill_first`).
A runtime error fails the requests it touched and nothing else: the batcher keeps serving.

Prefill/decode disaggregation (PD): a request submitted with `remote=True` is admitted into a
lane whose block waits for KV computed by a prefill worker (`import_kv` delivers it,
`transfer_ended` reports a transfer that ended without it); one submitted with `export=True` is
prefilled and then handed out (`take_export`, `export_done`) instead of decoded. While a
transfer is in flight the other lanes keep decoding. Which blocks a transfer uses, and when they
may be freed, is the core's business: an importing lane's table grows (`import_grow`) until it
covers the prompt, and only then is the transfer asked for (the "import" event); an abort
during a transfer leaves its blocks draining until the transfer's end is reported.

Transfers move positions, not blocks: `take_export` hands out the request's blocks as one host
tensor `[layers, 2, kv_heads, blocks * block_size, head_dim]`, and `import_kv` takes one with
at least the prompt's positions, written block by block (zeros past the prompt).
"""

from __future__ import annotations

import json
import operator
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

import attrs
import torch

from atom_core._generated import core, inplace
from atom_core.config import HOST_KV_REFUSAL, LOCAL_COPY_REFUSAL, Config
from atom_core.policy import Policy
from atom_core.replay import record
from atom_core.seq import seq
from atom_core.snapshots import SnapshotStore


@attrs.frozen
class Event:
    # "token" | "finished" | "error" | "preempted" (back in the waiting queue, its tokens so far
    # kept: it resumes where it stopped); PD: "import" (a lane waits for this request's KV: ask a
    # prefill worker for it) | "export" (this request's KV is ready: `take_export`)
    kind: str
    request_id: int
    token: int | None = None
    error: str | None = None


@attrs.frozen
class Result:
    tokens: list[int]
    error: str | None = None


@attrs.frozen(eq=False)
class Plan:
    """One step's runtime call, as `AtomBatcher.plan()` chose it: `call` is "prefill",
    "decode" or None (nothing to compute this step: `complete()` with no outputs). The inputs
    are the runtime's (`args()` in its order): token ids, positions, block tables (a prefill's
    one row, or decode's [B, T] with each padding row at its padding target), the local block
    tables of a hybrid model (else None) and, for a prefill, the index of the chunk's last
    token. `lanes` are the lanes computing (a prefill's one lane, or decode's live rows),
    `padding` decode's padding rows. `events` are those of the choices made so far (admissions,
    growth, preemptions); `complete()` returns them first. `effect` is the core's plan for the
    call (a `core.Prefill` or `core.Decode`), `pad` and `lpad` decode's padding targets."""

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

    def args(self) -> tuple[Any, ...]:
        """The runtime call's positional arguments."""
        if self.call == "prefill":
            return (self.ids, self.positions, self.tables, self.local, self.last)
        return (self.ids, self.positions, self.tables, self.local)


@attrs.frozen(eq=False)
class Export:
    """What `take_export` hands out: the request's prompt, its first generated token, a host
    tensor holding its blocks in token order (`runtime.new_host_buffer()` for one block, the
    blocks' buffers joined along positions for several), and for a hybrid model its lane's
    local slot (`runtime.new_local_host_buffer()`: its sliding window), else None."""

    prompt: list[int]
    first_token: int
    host: Any
    local_host: Any = None


@attrs.define
class Stats:
    prefill_tokens: int = 0  # prompt tokens computed by prefill
    prefix_hit_tokens: int = 0  # prompt tokens reused from the prefix cache (copied or adopted)
    decode_steps: int = 0
    decode_rows_padding: int = 0
    generated_tokens: int = 0
    runtime_errors: int = 0
    imported_tokens: int = 0  # prompt tokens whose KV a prefill worker computed
    exports: int = 0
    transfer_failures: int = 0
    stale_events: int = 0  # transfer events for requests that had no transfer (late, duplicate)
    host_stores: int = 0  # evicted cache entries stored into the host tier
    host_store_failures: int = 0  # stores that failed (the entry was dropped)
    host_hit_tokens: int = 0  # prompt tokens loaded from the host tier instead of computed
    host_load_failures: int = 0  # loads that failed (the request recomputed its prompt)
    snapshots: int = 0  # hybrid prefix cache: sliding-state snapshots taken
    snapshot_failures: int = 0  # fetches that failed (the lane just has no later snapshots)
    table_grows: int = 0  # blocks appended to lanes' tables (paged tables: T > 1)
    preemptions: int = 0  # requests sent back to the waiting queue to free their blocks
    recomputed_tokens: int = 0  # tokens whose KV a preemption dropped (computed again)
    forgotten: int = 0  # ended requests dropped past `keep_ended` (the core's `forget`)


@attrs.define
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | None
    remote: bool = False  # KV from a prefill worker
    export: bool = False  # prefill only, then hand the KV out
    tokens: list[int] = attrs.Factory(list)
    error: str | None = None
    # picks the request's next token from its logits [V]; None: greedy (argmax)
    sampler: Callable[[torch.Tensor], int] | None = None
    # the batcher whose core state holds the request's phase (read, never copied here)
    _batcher: AtomBatcher | None = attrs.field(default=None, repr=False, eq=False)

    @property
    def ended(self) -> bool:
        """Finished, aborted or failed (or forgotten since), as the core's phase says."""
        assert self._batcher is not None
        return self._batcher.phase(self.id) not in _LIVE


# the phases of a request that has not ended (waiting again after a preemption included)
_LIVE = frozenset((core.PHASE_WAITING, core.PHASE_PREFILL, core.PHASE_DECODE,
                   core.PHASE_IMPORTING, core.PHASE_EXPORTING))


def _token(t: Any) -> int:
    """A token id: an integer (numpy and torch integer scalars included), never a bool."""
    if isinstance(t, bool):
        raise TypeError("bool")
    return operator.index(t)


def _integer(value: Any) -> int | None:
    """`value` as an int if it is an integer (numpy and torch integer scalars included, as for
    token ids), else None: bool, float and str are not (1.0 or "1" must not pass as 1)."""
    try:
        return _token(value)
    except TypeError:
        return None


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in `t` (an integer tensor holds none). The one test of KV before it is
    written anywhere it is read: once in a block nothing downstream tells bad KV from good
    (attention softmaxes over it and every later token of the lane is plausible garbage, and a
    prefix-cache entry hands it to the next request sharing the prefix). `import_kv` and the
    PD payload's validation (`atom_core.pd.payload`) both ask it."""
    if not (t.is_floating_point() or t.is_complex()):
        return True
    return bool(torch.isfinite(t).all())


class InvariantViolation(AssertionError):
    def __init__(self, names: list[str]) -> None:
        super().__init__(f"core state violates invariants: {', '.join(names)}")
        self.names = names


class CoreRejected(RuntimeError):
    """The adapter asked the core for a transition its guard forbids: a bug in the adapter or
    the policy, never in the request."""


def check_runtime(cfg: Config, rt: Any) -> None:
    """The artifact the runtime runs must be the one the config describes."""
    wrong = [f"{name}: config {want}, runtime {getattr(rt, name)}"
             for name, want in (("num_blocks", cfg.kv_blocks), ("block_size", cfg.block_size),
                                ("max_seq_len", cfg.max_seq_len),
                                ("prefill_chunk", cfg.prefill_chunk))
             if hasattr(rt, name) and getattr(rt, name) != want]
    hybrid = bool(getattr(rt, "uses_local_block_tables", False))
    if hybrid != (cfg.sliding_window is not None):
        wrong.append(f"sliding_window: config {cfg.sliding_window}, runtime "
                     + ("has sliding-window layers" if hybrid else "has none"))
    elif hybrid and getattr(rt, "sliding_window", cfg.sliding_window) != cfg.sliding_window:
        wrong.append(f"sliding_window: config {cfg.sliding_window}, runtime {rt.sliding_window}")
    if cfg.host_cache_blocks and getattr(rt, "host_kv_transfers", True) is False:
        # a runtime whose block transfers to and from the host are not yet trusted (RBLN)
        wrong.append(f"host_cache_blocks: {HOST_KV_REFUSAL}")
    elif cfg.host_cache_blocks and not all(
            hasattr(rt, op) for op in ("new_host_buffer", "fetch_kv_cache", "update_kv_cache")):
        wrong.append("host_cache_blocks: the host tier stores and loads blocks through host "
                     "buffers (new_host_buffer/fetch_kv_cache/update_kv_cache), which this "
                     "runtime lacks; set host_cache_blocks=0")
    if hybrid and cfg.prefix_cache and not all(
            hasattr(rt, op) for op in ("new_local_host_buffer", "fetch_local_cache",
                                       "update_local_cache")):
        wrong.append(f"prefix_cache: {LOCAL_COPY_REFUSAL}")
    sizes = getattr(rt, "decoder_batch_sizes", None) or (getattr(rt, "batch_size", None),)
    if None not in sizes and cfg.lanes not in sizes:
        wrong.append(f"lanes: config {cfg.lanes}, runtime decode graphs {list(sizes)}")
    if wrong:
        raise ValueError("the runtime does not match the config (" + "; ".join(wrong)
                         + "): build the Config from the compiled artifact's settings")


class AtomBatcher:
    def __init__(self, config: Config, runtime: Any, *, policy: Policy | None = None,
                 ghost: bool = False, trace: IO[str] | None = None,
                 keep_ended: int | None = 10_000) -> None:
        """`keep_ended`: how many ended requests keep their `requests` entry (tokens, error)
        for the caller to read; older ones are forgotten (the core's `forget`), so memory does
        not grow with the requests served. None keeps every one."""
        if keep_ended is not None and (isinstance(keep_ended, bool)
                                       or not isinstance(keep_ended, int) or keep_ended < 0):
            raise ValueError(f"keep_ended must be an integer >= 0 or None, got {keep_ended!r}")
        self.keep_ended = keep_ended
        self._ended: deque[int] = deque()  # ended requests in the order they ended
        self.config, self.runtime = config, runtime
        check_runtime(config, runtime)
        self._hybrid = config.sliding_window is not None
        # hybrid prefix cache: host copies of sliding-window state at chunk boundaries
        self._snaps = SnapshotStore() if self._hybrid and config.prefix_cache else None
        self._host: dict[int, Any] = {}  # host tier: slot -> its host buffer (made on first use)
        self.policy = policy or Policy()
        # the core state, changed in place by each transition (`_apply`); `_version` counts the
        # transitions, so a pending plan can tell whether the state moved since it was made
        self._m = inplace.init(config.consts(), ghost=ghost)
        self._version = 0
        self._frozen: tuple[int, core.State] | None = None
        self.requests: dict[int, Request] = {}
        self.waiting: deque[int] = deque()
        self.stats = Stats()
        self._next_id = 0
        # (host buffer shape, dtype, (local slot shape, dtype) or None): import_kv's layout,
        # asked of the runtime on the first import
        self._import_ref: tuple[Any, ...] | None = None
        # each lane's block table in token order, kept from the core's effects (admit, grow,
        # release): what the runtime's block_tables rows hold
        self._tables: list[list[int]] = [[] for _ in range(config.lanes)]
        # the same as the runtime's [B, T] block_tables, each row padded with its tail
        # (positions past a lane's length are never read, and nothing is written there)
        self._tab = torch.zeros((config.lanes, config.blocks_per_table), dtype=torch.int16)
        self._trace = trace
        # the pending plan (between plan() and complete()) and the state version it was made in
        self._plan: Plan | None = None
        self._planned = -1
        if trace is not None:
            trace.write(json.dumps({"consts": attrs.asdict(config.consts())}) + "\n")

    # --------------------------------------------------------------- core state
    @property
    def state(self) -> core.State:
        """The core state, frozen (a `core.State`: immutable, compared and hashed by value).
        A copy made on the first read after a transition and kept until the next one, so two
        reads with nothing in between give the same object. For tests, tools and views; a hot
        path reads `view`."""
        if self._frozen is None or self._frozen[0] != self._version:
            self._frozen = (self._version, inplace.freeze(self._m))
        return self._frozen[1]

    @property
    def view(self) -> inplace.MState:
        """The core state itself (the in-place core's `MState`: the fields of `core.State` as
        lists and dicts), live: it changes with every transition. Read it, never write it, and
        only from the thread that drives the batcher."""
        return self._m

    def phase(self, request_id: int) -> int:
        """The core's phase of a request (`core.PHASE_*`; `PHASE_NONE` for one it does not
        know or has forgotten)."""
        return self._m.phase.get(request_id, core.PHASE_NONE)

    # --------------------------------------------------------------- client API
    def submit(self, prompt_ids: Iterable[int], max_new_tokens: int,
               eos_token_id: int | None = None, *, remote: bool = False,
               export: bool = False,
               sampler: Callable[[torch.Tensor], int] | None = None) -> int:
        """Queue a request; returns its id. `remote`: its prompt's KV comes from a prefill worker
        (see `import_kv`). `export`: prefill it and hand its KV out (see `take_export`).
        `sampler`: called with the logits [V] of each token this request generates here, returns
        the token (host-side sampling; called once per token, in order, so a seeded sampler
        repeats); None: greedy."""
        try:  # integers only: int() would truncate 1.7 and parse "5"
            prompt = [_token(t) for t in prompt_ids]
        except TypeError:
            raise ValueError("prompt token ids must be integers (not bool, float or str)") \
                from None
        vocab = getattr(self.runtime, "vocab_size", None)
        if not prompt:
            raise ValueError("empty prompt: give at least one token")
        if vocab is not None and not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt has token ids outside the vocabulary 0..{vocab - 1}")
        # integers as the prompt's ids are: numpy and torch integer scalars too (a count or an
        # eos read from an array), stored as int so they compare and serialise as one
        n_new = _integer(max_new_tokens)
        if n_new is None or n_new < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        eos = None if eos_token_id is None else _integer(eos_token_id)
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
        rid = self._next_id
        planned = self._plan is not None and self._version == self._planned
        self._apply("submit", r=rid, p=seq(prompt))
        if planned:  # a new waiting request changes nothing a pending plan chose
            self._planned = self._version
        self._next_id += 1
        self.requests[rid] = Request(rid, prompt, n_new, eos, remote=remote,
                                     export=export, sampler=sampler, batcher=self)
        self.waiting.append(rid)
        return rid

    def abort(self, request_id: int) -> bool:
        """End a request early. False (and nothing changes) for an unknown or ended request.
        Not while a plan is pending (between `plan()` and `complete()`): a RuntimeError, and
        nothing changes; abort after `complete()`."""
        rid = _integer(request_id)
        if rid is None:
            # 1.0 == 1 as a dict key: a float would abort request 1
            raise ValueError(f"request ids are integers (from submit), got {request_id!r}")
        request_id = rid
        self._no_pending_plan("abort")
        req = self.requests.get(request_id)
        if req is None or req.ended:
            return False
        phase = self._m.phase.get(request_id)
        if phase == core.PHASE_WAITING:
            self.waiting.remove(request_id)
            self._apply("abort_waiting", r=request_id)
        else:  # a block in a transfer drains until `transfer_ended` (see the module doc)
            asked = self.awaits_kv(request_id)
            self._apply("abort_running", l=self._m.req_lane.get(request_id))
            if phase == core.PHASE_IMPORTING and not asked:
                # its table was still growing: nobody was asked for its KV, so no end of that
                # transfer will ever be reported; it ends here (nothing wrote the blocks)
                self._apply("transfer_end", r=request_id, b=self._draining(request_id))
        req.error = "aborted"
        self._ended_now(request_id)
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

    # --------------------------------------------------------------- PD
    def make_local(self, request_id: int) -> bool:
        """A waiting remote request is prefilled here instead (e.g. its prefill worker is gone);
        it keeps its id and queue position. False if it is not waiting or not remote."""
        req = self.requests.get(request_id)
        if (req is None or not req.remote
                or self._m.phase.get(request_id) != core.PHASE_WAITING):
            return False
        req.remote = False
        return True

    def import_kv(self, request_id: int, prompt_ids: Iterable[int], first_token: int,
                  host_kv: Any, local_kv: Any = None) -> list[Event]:
        """The transfer for `request_id` delivered KV for `prompt_ids` and the first generated
        token. `host_kv` is `[layers, 2, kv_heads, n, head_dim]` in the runtime's host layout
        with n >= the prompt's length (`runtime.new_host_buffer()` when it fits one block);
        positions from the prompt's length on are not read (except that a buffer of exactly
        one block, into a one-block table, is written as it is, so they must be finite there).
        Accepted only if it covers the request's whole prompt, the request's table is in place
        (after its "import" event) and every value written is finite (`all_finite`); otherwise
        the request fails, and nothing is written or cached. Events for requests without a
        transfer change nothing.

        Hybrid models: `local_kv` is the prompt's sliding window (a local host buffer,
        `runtime.new_local_host_buffer()` layout), written into the request's lane's local slot;
        without it the request fails like a partial import. A plain model takes none."""
        self._no_pending_plan("import_kv")
        events: list[Event] = []
        phase = self._m.phase.get(request_id)
        if phase != core.PHASE_IMPORTING:
            self._stale_or_drained(request_id)
            return events
        try:  # integers only, as in submit: int() would turn 1.9 into 1
            ids = [_token(t) for t in prompt_ids]
            first_token = _token(first_token)
        except TypeError:
            self._transfer_failed(request_id, "import rejected: token ids must be integers",
                                  events)
            return events
        vocab = getattr(self.runtime, "vocab_size", None)
        if vocab is not None and not 0 <= first_token < vocab:
            # a token the model cannot embed would fail the next decode call for every lane
            self._transfer_failed(request_id, f"import rejected: first token {first_token} is "
                                  f"outside the vocabulary 0..{vocab - 1}", events)
            return events
        p = seq(ids)
        s = self._m
        if not inplace.table_covers_prompt(s, s.req_lane.get(request_id)):
            self._transfer_failed(request_id, "import rejected (table_covers_prompt): the "
                                  "request's table does not cover its prompt yet; call "
                                  "import_kv after its import event (`awaits_kv`)", events)
            return events
        if not inplace.enabled_import_done(s, r=request_id, p=p, tok=first_token):
            bad = inplace.import_done_guard(s, request_id, p, first_token)  # (for the message)
            self._transfer_failed(request_id, f"import rejected ({bad}): the KV covers "
                                  f"{len(p)} tokens, not this request's prompt", events)
            return events
        if self._hybrid and local_kv is None:
            # The spec's import_done delivers the sliding state too (local_holds := p): without
            # it the lane's sliding layers would attend to its slot's stale content.
            self._transfer_failed(request_id, "import rejected (local_kv): this model is hybrid "
                                  "and the transfer delivered no sliding-window state for the "
                                  "lane's local slot; ship the prefill lane's local window "
                                  "(take_export(...).local_host)", events)
            return events
        if not self._hybrid and local_kv is not None:
            self._transfer_failed(request_id, "import rejected (local_kv): the transfer "
                                  "delivered sliding-window state, but this model has no "
                                  "sliding-window layers: the prefill side runs another model",
                                  events)
            return events
        try:
            bad_kv = self._import_mismatch(host_kv, local_kv, len(ids))
        except Exception as exc:  # noqa: BLE001 - the runtime could not say its layout
            bad_kv = f"the runtime's host buffer layout is unavailable ({exc!r})"
        lane = self._m.req_lane.get(request_id)
        if bad_kv is None:
            try:
                bad_kv = self._non_finite(host_kv, local_kv, len(ids), self._tables[lane])
            except Exception as exc:  # noqa: BLE001 - values that cannot be read (a meta tensor)
                bad_kv = f"host_kv or local_kv values cannot be read ({exc!r})"
        if bad_kv is not None:
            field = "local_kv" if bad_kv.startswith("local_kv") else "host_kv"
            self._transfer_failed(request_id, f"import rejected ({field}): {bad_kv}", events)
            return events
        try:
            self._write_blocks(host_kv, len(ids), self._tables[lane])
        except Exception as exc:  # noqa: BLE001 - this request's import failed, nothing else
            self._transfer_failed(request_id, f"update_kv_cache failed: {exc!r}", events)
            return events
        if self._hybrid:
            # the whole slot: the window holds the last min(plen, W) positions in order, as
            # the prefill lane's did, so it is valid as-is at the same length
            try:
                self.runtime.update_local_cache(local_kv, lane)
            except Exception as exc:  # noqa: BLE001 - this request's import failed
                self._transfer_failed(request_id, f"update_local_cache failed: {exc!r}", events)
                return events
        self._apply("import_done", r=request_id, p=p, tok=first_token)
        self.stats.imported_tokens += len(p)
        self._emit_token(self._m.req_lane.get(request_id), first_token, events)
        return events

    def transfer_ended(self, request_id: int, error: str) -> list[Event]:
        """The transfer for `request_id` ended without usable KV (an error, a bad payload, a lost
        peer): a request still waiting for it fails; a drained block is freed. Unknown or
        already-ended requests: nothing changes."""
        self._no_pending_plan("transfer_ended")
        events: list[Event] = []
        if self._m.phase.get(request_id) in (core.PHASE_IMPORTING, core.PHASE_EXPORTING):
            self._transfer_failed(request_id, error, events)
        else:
            self._stale_or_drained(request_id)
        return events

    def take_export(self, request_id: int) -> Export:
        """The prompt, first token and host KV buffer of an exported request, read from its
        pinned block, and for a hybrid model its lane's local slot (the lane stays the request's
        until `export_done`). Call `export_done` once the KV is handed to the transport, or
        `export_done(request_id, error)` if this raises (a runtime read or allocation failed)."""
        s = self._m
        if s.phase.get(request_id) != core.PHASE_EXPORTING:
            raise KeyError(f"request {request_id} has no export pending")
        lane = s.req_lane.get(request_id)
        host = self._read_blocks(self._tables[lane])
        local = None
        if self._hybrid:
            local = self.runtime.new_local_host_buffer()
            self.runtime.fetch_local_cache(local, lane)
        # the first token is the one the core's sequence holds past the prompt
        return Export(self.requests[request_id].prompt, s.lane_seq[lane][s.lane_plen[lane]],
                      host, local)

    def export_done(self, request_id: int, error: str | None = None) -> list[Event]:
        """The export of `request_id` was sent (error None) or could not be: its block is
        released (into the prefix cache when on)."""
        self._no_pending_plan("export_done")
        events: list[Event] = []
        if self._m.phase.get(request_id) != core.PHASE_EXPORTING:
            self._stale_or_drained(request_id)
            return events
        if error is not None:
            self._transfer_failed(request_id, error, events)
            return events
        self._apply("export_done", r=request_id, keep=self.config.prefix_cache)
        self.stats.exports += 1
        events.append(Event("finished", request_id))
        self._ended_now(request_id)
        return events

    def awaits_kv(self, request_id: int) -> bool:
        """The request's lane has its whole table and its "import" event went out: `import_kv`
        can write its KV now (before that, keep the KV until the event). The event goes out
        exactly when an importing lane's table comes to cover the prompt (`_import_ready`), so
        the core's state says whether it has."""
        s = self._m
        return (s.phase.get(request_id) == core.PHASE_IMPORTING
                and inplace.table_covers_prompt(s, s.req_lane.get(request_id)))

    def transfers(self) -> dict[int, int]:
        """Unfinished transfers, as the core records them (`transfer`, `transfer_req`):
        request -> the lowest-numbered block its transfer uses (including requests whose blocks
        drain after an abort)."""
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

    def new_import_buffer(self) -> torch.Tensor:
        """A host tensor for `import_kv` as long as a lane's table (max_seq_len positions) in
        the runtime's host layout: `pd.write_into(payload, buffer)` fits any prompt."""
        one = self.runtime.new_host_buffer()
        if self.config.blocks_per_table == 1:
            return one
        return one.new_zeros((*one.shape[:3], self.config.max_seq_len, one.shape[4]))

    def _import_mismatch(self, host_kv: Any, local_kv: Any, n: int) -> str | None:
        """Why `host_kv` (and `local_kv`) is not exactly what import_kv takes, naming the field;
        None if it is. `host_kv` has the layout and dtype of `runtime.new_host_buffer()` with n
        to max_seq_len positions, `local_kv` exactly those of `new_local_host_buffer()`: no
        broadcasting (a [1, ...] tensor would fill every layer), no silent casting."""
        if self._import_ref is None:
            one = self.runtime.new_host_buffer()
            local = self.runtime.new_local_host_buffer() if self._hybrid else None
            self._import_ref = (tuple(one.shape), one.dtype,
                                None if local is None else (tuple(local.shape), local.dtype))
        (layers, kv, heads, _, dim), dtype, local_ref = self._import_ref
        if not isinstance(host_kv, torch.Tensor):
            return f"host_kv must be a torch.Tensor, got {type(host_kv).__name__}"
        shape = tuple(host_kv.shape)
        if len(shape) != 5:
            return (f"host_kv must be [layers, 2, kv_heads, positions, head_dim], got shape "
                    f"{list(shape)}; write the payload into new_import_buffer()")
        for name, got, want in (("layers", shape[0], layers), ("K/V", shape[1], kv),
                                ("kv_heads", shape[2], heads), ("head_dim", shape[4], dim)):
            if got != want:
                return (f"host_kv {name} is {got}, this runtime's host buffer has {want} "
                        f"(shape {list(shape)}); write the payload into new_import_buffer()")
        if not n <= shape[3] <= self.config.max_seq_len:
            return (f"host_kv positions is {shape[3]} (shape {list(shape)}), it must cover the "
                    f"prompt's {n} tokens and at most max_seq_len={self.config.max_seq_len}")
        if host_kv.dtype != dtype:
            return (f"host_kv dtype is {host_kv.dtype}, this runtime's cache is {dtype}: no "
                    "silent casting; ship KV in the cache dtype")
        if local_kv is not None and local_ref is not None:
            if not isinstance(local_kv, torch.Tensor):
                return f"local_kv must be a torch.Tensor, got {type(local_kv).__name__}"
            if tuple(local_kv.shape) != local_ref[0]:
                return (f"local_kv shape is {list(local_kv.shape)}, this runtime's local slot "
                        f"is {list(local_ref[0])}")
            if local_kv.dtype != local_ref[1]:
                return (f"local_kv dtype is {local_kv.dtype}, this runtime's cache is "
                        f"{local_ref[1]}: no silent casting")
        return None

    def _non_finite(self, host_kv: torch.Tensor, local_kv: torch.Tensor | None, n: int,
                    table: list[int]) -> str | None:
        """Why the KV import_kv would write is not all finite, naming the field; None if it
        is. Only what reaches the device is read: the prompt's positions of `host_kv`, or all
        of it when it goes as given (`_as_given`), and the whole local slot."""
        written = host_kv if self._as_given(host_kv, table) else host_kv[:, :, :, :n]
        for name, t in (("host_kv", written), ("local_kv", local_kv)):
            if t is not None and not all_finite(t):
                return (f"{name} holds non-finite values (NaN or inf): its producer diverged or "
                        "the buffer is damaged, and decode would attend to it; nothing was "
                        "written")
        return None

    def _as_given(self, host_kv: torch.Tensor, table: list[int]) -> bool:
        """`_write_blocks` writes `host_kv` into the lane's one block as it is (past the
        prompt too), not position by position."""
        return len(table) == 1 and host_kv.shape[3] == self.config.block_size

    def _write_blocks(self, host_kv: Any, n: int, table: list[int]) -> None:
        """Positions [0, n) of `host_kv` into `table`'s blocks, zeros past n: a block then holds
        nothing of an earlier request, and its content is a function of the payload alone."""
        size = self.config.block_size
        if self._as_given(host_kv, table):  # one whole block: as given
            self.runtime.update_kv_cache(host_kv, table[0])
            return
        buf = self.runtime.new_host_buffer()
        for i, block in enumerate(table):
            part = host_kv[:, :, :, i * size:min((i + 1) * size, n)]
            buf.zero_()
            buf[:, :, :, :part.shape[3]].copy_(part)
            self.runtime.update_kv_cache(buf, block)

    def _read_blocks(self, table: list[int]) -> Any:
        bufs = []
        for block in table:
            buf = self.runtime.new_host_buffer()
            self.runtime.fetch_kv_cache(buf, block)
            bufs.append(buf)
        return bufs[0] if len(bufs) == 1 else torch.cat(bufs, dim=3)

    def _transfer_failed(self, rid: int, error: str, events: list[Event]) -> None:
        self._apply("transfer_fail", r=rid)
        self.stats.transfer_failures += 1
        self.requests[rid].error = error
        events.append(Event("error", rid, error=error))
        self._ended_now(rid)

    def _stale_or_drained(self, rid: int) -> None:
        block = self._draining(rid)
        if block is not None:
            self._apply("transfer_end", r=rid, b=block)
            self._trim_ended()  # it may have held back older ones
        else:
            self.stats.stale_events += 1

    def _ended_now(self, rid: int) -> None:
        if self.keep_ended is not None:
            self._ended.append(rid)
            self._trim_ended()

    def forget(self, request_id: int) -> bool:
        """Drop an ended request now (its `requests` entry and the core's record of it). False,
        and nothing changes, for a request that has not ended or whose blocks still drain."""
        if request_id not in self.requests or not inplace.enabled_forget(self._m, r=request_id):
            return False
        planned = self._plan is not None and self._version == self._planned
        self._apply("forget", r=request_id)
        if planned:  # an ended request holds nothing a pending plan chose (as submit)
            self._planned = self._version
        del self.requests[request_id]
        if request_id in self._ended:  # (rare: callers that forget use keep_ended=None)
            self._ended.remove(request_id)
        self.stats.forgotten += 1
        return True

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

    def step(self) -> list[Event]:
        """One step: `plan()`, the runtime call it names, `complete()`."""
        plan = self.plan()
        if plan.call is None:
            return self.complete()
        try:
            out = getattr(self.runtime, plan.call)(*plan.args())
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
        events: list[Event] = []
        # running lanes get their next blocks before an admission can take them, and an
        # admission whose hit fills its first block grows before the next call
        self._grow(events)
        before = self._version
        self._admit(events)
        if self._version != before:  # (else the state is the one the first pass left: no lane
            self._grow(events)       # needs a block, and asking again costs B guard checks)
        lane = self._prefilling_lane()
        if lane is not None and not self.policy.prefill_first(self._m, self._can_decode):
            lane = None  # decoding lanes waited long enough: a decode call goes first
        plan = self._plan_prefill(lane, events) if lane is not None \
            else self._plan_decode(events)
        self._plan, self._planned = plan, self._version
        return plan

    def complete(self, logits: Any = None, *, tokens: Sequence[int] | None = None,
                 error: BaseException | None = None) -> list[Event]:
        """End the planned step: `logits` are the planned call's output ([1, 1, V] for a
        prefill, or the whole chunk's [1, c, V], read at the chunk's last real token; [B, 1, V]
        for decode; none when the plan has no call), or `tokens` the tokens an engine sampled
        from them (one for a prefill, read only for the prompt's last chunk; one per row for
        decode, padding rows' ignored; the requests' own samplers are then not called, and a
        token that is not an id in the vocabulary fails its request alone), or `error` the
        exception the call raised (it fails the requests the call touched, nothing else).
        Logits of another shape fail the call's requests; a row whose logits are not finite
        (NaN, inf) fails its request alone. Returns the step's events, the plan's first."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("complete() called without a pending plan: call plan() first "
                               "(once per complete())")
        self._plan = None
        if self._version != self._planned:
            raise RuntimeError("the batcher changed between plan() and complete() (abort or a "
                               "PD call): its plan no longer holds")
        events = list(plan.events)
        if plan.call == "prefill":
            self._complete_prefill(plan, logits, tokens, error, events)
        elif plan.call == "decode":
            self._complete_decode(plan, logits, tokens, error, events)
        return events

    def busy(self) -> bool:
        s = self._m
        return bool(self.waiting) or any(s.busy) or any(s.transfer)

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

    # --------------------------------------------------------------- host tier
    def _spill(self, block: int) -> bool:
        """Store cache entry `block` into the host tier before it is evicted, evicting the least
        recently used host entry when every slot is full. False if no slot can take it, or the
        host tier already holds it (the device entry is then simply evicted). A failed store
        drops the entry; either way the block is free afterwards."""
        place = self.policy.spill_slot(self._m, block)
        if place is None:
            return False
        slot, evict = place
        if evict:
            self._apply("host_evict", h=slot)
        self._dispatch(self._apply("spill", b=block, h=slot), [])
        return True

    def _store(self, eff: Any) -> None:
        """Store a spilled block into its host slot and end the store (`store_done`); a failed
        store (`store_fail`) loses only that entry: its block is free either way."""
        try:  # the allocation too: host memory can run out, and the store must still end
            if eff.slot not in self._host:
                self._host[eff.slot] = self.runtime.new_host_buffer()
            self.runtime.fetch_kv_cache(self._host[eff.slot], eff.block)
        except Exception:  # noqa: BLE001 - only this entry is lost
            self._apply("store_fail", h=eff.slot)
            self.stats.host_store_failures += 1
            return
        self._apply("store_done", h=eff.slot)
        self.stats.host_stores += 1

    def _load(self, eff: Any) -> None:
        """A host-tier hit: load the slot into the lane's fresh block. If the load fails, the
        request recomputes that block's tokens (the core's `load_fail`); nothing else is
        affected."""
        try:
            self.runtime.update_kv_cache(self._host[eff.slot], eff.dst)
        except Exception:  # noqa: BLE001 - the request recomputes; the host entry is intact
            self._apply("load_fail", l=eff.lane)
            self.stats.host_load_failures += 1
            return
        self._apply("load_done", l=eff.lane)
        self.stats.host_hit_tokens += eff.n

    def _is_cache_entry(self, block: int) -> bool:
        return self._m.owner[block] == core.OWNER_CACHE

    def check_invariants(self) -> None:
        """The core's invariants, and that the block tables kept from its effects (`_tables`,
        what the runtime is given) are the core's: each busy lane's blocks in token order."""
        s = self._m
        bad = inplace.check_invariants(s) + [
            f"index {ix} differs from its fields" for ix in inplace.check_indexes(s)]
        if not bad:
            for ln in range(s.consts.B):
                owned = sorted((s.start[b], b) for b in range(s.consts.K)
                               if s.owner[b] == core.OWNER_LANE and s.owner_lane[b] == ln)
                want = [b for _start, b in owned] if s.busy[ln] else []
                if self._tables[ln] != want:
                    bad.append(f"lane {ln}'s block table {self._tables[ln]} is not the core's "
                               f"{want}")
        if bad:
            raise InvariantViolation(bad)

    def describe(self) -> dict[str, Any]:
        s = self._m
        pins = self.policy.pinned(s)
        lanes = [{"lane": ln, "request": s.lane_req[ln] if s.busy[ln] else None,
                  "length": s.length[ln] if s.busy[ln] else 0, "blocks": list(self._tables[ln])}
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
        # host memory the adapter holds for the core's snapshots (each one a local slot)
        snaps = ({"lanes": {ln: sorted(v) for ln, v in self._snaps.lanes.items()},
                  "entries": {b: sorted(v) for b, v in self._snaps.entries.items()}}
                 if self._snaps is not None else None)
        return {"lanes": lanes, "blocks": owners, "cache": cache, "host_cache": host,
                "snapshots": snaps,
                "waiting": list(self.waiting), "stats": attrs.asdict(self.stats)}

    # --------------------------------------------------------------- core plumbing
    def _apply(self, action: str, **args: Any) -> core.Step:
        step = inplace.ACTIONS[action][0](self._m, **args)
        if step.rejected is not None:
            raise CoreRejected(f"{action}({args}) rejected by guard {step.rejected}")
        self._version += 1
        self.policy.observe(step.effects)
        for eff in step.effects:
            if isinstance(eff, (core.Admit, core.Inbound)):
                self._tables[eff.lane] = [eff.block]
                self._tab[eff.lane] = eff.block
            elif isinstance(eff, core.Grow):
                assert eff.pos == len(self._tables[eff.lane]), (eff, self._tables[eff.lane])
                self._tables[eff.lane].append(eff.block)
                self._tab[eff.lane, eff.pos:] = eff.block
            elif isinstance(eff, (core.Release, core.Preempt)):
                self._tables[eff.lane] = []
        if self._snaps is not None:
            self._move_snapshots(step.effects)
        if self._trace is not None:
            self._trace.write(json.dumps(record(action, args, step.effects)) + "\n")
        return step

    def _move_snapshots(self, effects: Iterable[Any]) -> None:
        assert self._snaps is not None
        for eff in effects:
            if isinstance(eff, (core.Admit, core.Inbound)):
                self._snaps.admitted(eff.lane, None)
            elif isinstance(eff, core.Grow):  # (before a grow_hit's Copy: the lane's own)
                self._snaps.filled(eff.lane, self._tables[eff.lane][eff.pos - 1])
            elif isinstance(eff, core.Copy):
                self._snaps.admitted(eff.lane, eff.src)
            elif isinstance(eff, core.Release):
                self._snaps.released(eff.lane, eff.block)
        self._snaps.sync(self._m)

    def _snapshot(self, lane: int) -> None:
        """Hybrid prefix cache: keep the lane's sliding state at this chunk boundary. A failed
        fetch costs only later hits their snapshot (the core then allows no later one)."""
        if self._snaps is None or not self.policy.snapshot(self._m, lane):
            return
        try:  # allocation included: a snapshot is an optimisation, never worth a request
            host = self.runtime.new_local_host_buffer()
            self.runtime.fetch_local_cache(host, lane)
        except Exception:  # noqa: BLE001 - a read: the lane's state is intact, it just has no copy
            self.stats.snapshot_failures += 1
            return
        (eff,) = self._apply("snapshot", l=lane).effects
        self._snaps.taken(lane, eff.n, host)
        self.stats.snapshots += 1

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

    # --------------------------------------------------------------- admission
    def _admit(self, events: list[Event]) -> None:
        while self.waiting:
            rid = self.waiting[0]
            choice = self.policy.admission(self._m, rid, remote=self.requests[rid].remote)
            if choice is None:
                return
            dst = choice.args.get("dst")  # (none for admit_adopt: it takes its source over)
            if (self.config.host_cache_blocks and dst is not None and self._is_cache_entry(dst)
                    and self._spill(dst)):
                continue  # the entry went to the host tier; its block is free now: choose again
            self.waiting.popleft()
            self._dispatch(self._apply(choice.action, **choice.args), events)
            if choice.action == "admit_adopt":  # a hit with nothing to copy: the entry's block
                self.stats.prefix_hit_tokens += choice.args["n"]

    def _dispatch(self, step: core.Step, events: list[Event]) -> None:
        """Run what an applied choice's effects ask of the runtime, in their order: a prefix
        hit's copy (`Copy`), a host-tier load (`Load`), a store into the host tier (`Store`);
        and ask for an import's KV once its table covers the prompt (`Inbound`, `Grow`). The
        one place effects become runtime calls, besides the step's own prefill or decode call,
        which `plan()` builds from the core's `*_plan` effects; `_apply` keeps the block tables
        from the same effects."""
        for eff in step.effects:
            kind = type(eff)
            if kind is core.Copy:
                self._copy(eff, events)
            elif kind is core.Load:
                self._load(eff)
            elif kind is core.Store:
                self._store(eff)
            elif kind is core.Inbound or kind is core.Grow:
                self._import_ready(eff.lane, events)

    def _copy(self, eff: Any, events: list[Event]) -> None:
        """Run a prefix hit's copy (an admission's, or a `grow_hit`'s into a later block) and
        end it (`copy_done`); a failed copy fails its request only."""
        try:
            self.runtime.copy_kv_cache(eff.src, eff.dst, eff.n)
        except Exception as exc:  # noqa: BLE001 - any runtime failure fails this one
            self._end(eff.lane, events, f"copy_kv_cache failed: {exc!r}")
            return
        if self._snaps is not None:  # the hit's sliding state (spec: copy_done)
            try:
                self.runtime.update_local_cache(
                    self._snaps.restore_source(eff.src, self._m.length[eff.lane]),
                    eff.lane)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                self._end(eff.lane, events, f"update_local_cache failed: {exc!r}")
                return
        self._apply("copy_done", l=eff.lane)
        self.stats.prefix_hit_tokens += eff.n

    def _import_ready(self, lane: int, events: list[Event]) -> None:
        """Ask for lane's KV ("import") once its table covers the prompt: the core refuses to
        grow it further exactly then."""
        s = self._m
        if inplace.importing(s, lane) and inplace.table_covers_prompt(s, lane):
            events.append(Event("import", self._m.lane_req[lane]))

    # --------------------------------------------------------------- paged tables
    def _grow(self, events: list[Event]) -> None:
        """Every lane whose tail block is full gets its next block before the next runtime call
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
            if choice.action == "preempt":
                self._preempt_lane(choice.args["l"], events)
                continue
            dst = choice.args.get("dst")  # (none for grow_adopt: it takes its source over)
            if (self.config.host_cache_blocks and dst is not None and self._is_cache_entry(dst)
                    and self._spill(dst)):
                continue  # the entry went to the host tier; its block is free now: choose again
            self.stats.table_grows += 1
            self._dispatch(self._apply(choice.action, **choice.args), events)
            if choice.action == "grow_adopt":  # a hit with nothing to copy: the entry's block
                self.stats.prefix_hit_tokens += choice.args["n"]

    def _preempt(self, events: list[Event]) -> bool:
        """Free a lane's blocks for a lane that waits for one (`Policy.victim`); its request
        goes to the front of the waiting queue and, when admitted again, prefills its prompt
        and the tokens it has so far, so its next token is the one it would have decoded."""
        if not self.config.preemption:
            return False
        lane = self.policy.victim(self._m)
        if lane is None:
            return False
        self._preempt_lane(lane, events)
        return True

    def _preempt_lane(self, lane: int, events: list[Event]) -> None:
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
        targets. (`_plan_decode` preempts when there is no padding target: asked only when no
        lane can prefill, never to make room for a decode call a prefill could replace.)"""
        s = self._m
        plan = inplace.decode_plan(s, self.policy.pad(s), self.policy.local_pad(s), None)
        return not isinstance(plan, str) and any(plan[0].live)

    def _prefilling_lane(self) -> int | None:
        # the oldest prefilling lane, not the lowest: see `Policy.prefill_lane`
        return self.policy.prefill_lane(self._m)

    def _plan_prefill(self, lane: int, events: list[Event]) -> Plan:
        (eff,) = inplace.prefill_plan(self._m, lane, None)
        req = self.requests[self._m.lane_req[lane]]
        prompt = req.prompt + req.tokens  # after a preemption: its tokens so far too
        c = self.config.prefill_chunk
        chunk = prompt[eff.start:eff.end]
        ids = torch.zeros((1, c), dtype=torch.int64)
        ids[0, :len(chunk)] = torch.tensor(chunk, dtype=torch.int64)
        pos = torch.arange(eff.start, eff.start + c, dtype=torch.int32).unsqueeze(0)
        assert self._tables[lane][eff.start // self.config.block_size] == eff.block, eff
        # hybrid: the lane's own local slot (local_block_tables[lane] == lane)
        local = torch.tensor([lane], dtype=torch.int16) if self._hybrid else None
        return Plan("prefill", tuple(events), ids, pos, self._tab[lane].clone(), local,
                    torch.tensor(len(chunk) - 1, dtype=torch.int16), lanes=(lane,), effect=eff)

    def _logit_rows(self, logits: Any, rows: int, last: int | None) -> torch.Tensor:
        """The planned call's logits as [rows, V]: each computed row's last position; for a
        prefill given the whole chunk's logits [1, C, V] (`complete` takes them), the chunk's
        last real token (`last`), not position C - 1, which a short last chunk only pads.
        Anything else raises, naming the shape: a [1, V] prefill output would otherwise read as
        one scalar (argmax 0) and a decode output with too few rows would break the step;
        logits wider than the runtime's vocabulary would sample a token the next call cannot
        embed, failing every lane."""
        c, vocab = self.config.prefill_chunk, getattr(self.runtime, "vocab_size", None)
        want = (f"[1, 1 or C={c}, V={vocab}]" if last is not None
                else f"[B={rows}, 1, V={vocab}]")
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"logits must be a torch.Tensor {want}, got {type(logits).__name__}")
        shape = tuple(logits.shape)
        if len(shape) != 3 or shape[0] != rows or shape[1] < 1 or shape[2] < 1 \
                or vocab is not None and shape[2] != vocab \
                or last is not None and shape[1] not in (1, c):
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

    def _complete_prefill(self, plan: Plan, logits: Any, tokens: Sequence[int] | None,
                          error: BaseException | None, events: list[Event]) -> None:
        (lane,), eff = plan.lanes, plan.effect
        rid = self._m.lane_req[lane]
        req = self.requests[rid]
        emits = eff.end == len(req.prompt) + len(req.tokens)  # the prompt's last chunk
        tok, row = 0, None
        if error is None and tokens is None:
            try:
                row = self._logit_rows(logits, 1, int(plan.last))
                (tok,), (finite,) = self._greedy(row)
                if not finite:
                    raise ValueError(f"the logits are not finite (NaN or inf; row max "
                                     f"{float(row[0, tok])})")
            except Exception as exc:  # noqa: BLE001 - logits the call got wrong
                error = exc
        if error is not None:
            self._end(lane, events, f"prefill failed: {error!r}")
            return
        if tokens is not None and emits:
            # (a chunk that emits nothing never reads its token: an engine need not sample it)
            try:
                (tok,) = tokens
                tok = self._checked(tok)
            except Exception as exc:  # noqa: BLE001 - this request's token, nothing else
                self._end(lane, events, f"token rejected: {exc!r}")
                return
        elif tokens is None and req.sampler is not None and emits:
            assert row is not None
            try:
                tok = self._sample(req, row[0])
            except Exception as exc:  # noqa: BLE001 - this request's sampler, nothing else
                self._end(lane, events, f"sampler failed: {exc!r}")
                return
        self.stats.prefill_tokens += eff.end - eff.start
        self._apply("prefill", l=lane, tok=tok)
        self._snapshot(lane)
        if emits:
            if req.export:
                self._apply("export", l=lane)
                events.append(Event("export", rid, token=tok))
            else:
                self._emit_token(lane, tok, events)

    # --------------------------------------------------------------- decode
    def _plan_decode(self, events: list[Event]) -> Plan:
        while True:
            s = self._m
            pad, lpad = self.policy.pad(s), self.policy.local_pad(s)
            plan = inplace.decode_plan(s, pad, lpad, None)
            if isinstance(plan, str):
                # no lane decodes, or no padding target yet: a prefill comes first, or (with
                # preemption, every block held by lanes) a lane makes room; or (hybrid) every
                # lane is busy and one is not decoding, so no local slot may take padding:
                # that lane prefills or its transfer ends first
                self._preempt(events)
                return Plan(None, tuple(events))
            (eff,) = plan
            if not (self.config.host_cache_blocks and not all(eff.live)
                    and self._is_cache_entry(pad) and self._spill(pad)):
                break
            # padding would evict that entry: it went to the host tier first; choose again
        lanes = tuple(ln for ln, live in enumerate(eff.live) if live)
        if not lanes:
            return Plan(None, tuple(events))
        ids = torch.tensor([[self.requests[s.lane_req[ln]].tokens[-1] if live else 0]
                            for ln, live in enumerate(eff.live)], dtype=torch.int64)
        pos = torch.tensor(eff.positions, dtype=torch.int32).unsqueeze(1)
        # a decoding row: its lane's table (its write lands in the block the spec names); a
        # padding row: the padding target at every position, so its write lands there whatever
        # position the row computes
        tables = self._tab.clone()
        for ln, live in enumerate(eff.live):
            if live:
                assert self._tables[ln][eff.positions[ln] // self.config.block_size] == \
                    eff.rows[ln], (self._tables[ln], eff)
            else:
                tables[ln] = eff.rows[ln]
        # hybrid: the local slot the spec gives each row (a decoding lane its own; padding rows
        # an idle lane's, whose window they may overwrite)
        local = torch.tensor(eff.local, dtype=torch.int16).unsqueeze(1) if self._hybrid else None
        padding = tuple(ln for ln, live in enumerate(eff.live) if not live)
        return Plan("decode", tuple(events), ids, pos, tables, local, lanes=lanes,
                    padding=padding, effect=eff, pad=pad, lpad=lpad)

    def _complete_decode(self, plan: Plan, logits: Any, tokens: Sequence[int] | None,
                         error: BaseException | None, events: list[Event]) -> None:
        s, lanes = self._m, plan.lanes
        rows, finite = None, None
        if error is None:
            try:
                if tokens is None:
                    rows = self._logit_rows(logits, s.consts.B, None)
                    toks, finite = self._greedy(rows)
                elif len(tokens) != s.consts.B:
                    raise ValueError(f"{len(tokens)} tokens for {s.consts.B} rows")
                else:
                    toks = list(tokens)
            except Exception as exc:  # noqa: BLE001 - outputs the call got wrong
                error = exc
        if error is not None:
            # Every row was computed, so every row's target may be half-written.
            for ln in lanes:
                self._end(ln, events, f"decode failed: {error!r}")
            if plan.padding:
                self._apply("discard", b=plan.pad)
            return
        # a request's own sampler failing fails that request alone, after the step (its row's
        # KV was written like every other row's)
        bad: dict[int, str] = {}
        for ln, live in enumerate(plan.effect.live):
            if not live:
                if tokens is not None:
                    toks[ln] = 0  # (the engine's for a padding row: never used, maybe None)
                continue
            req = self.requests[s.lane_req[ln]]
            if tokens is not None:
                try:
                    toks[ln] = self._checked(toks[ln])
                except Exception as exc:  # noqa: BLE001
                    bad[ln], toks[ln] = f"token rejected: {exc!r}", 0
            elif finite is not None and not finite[ln]:
                # this row's logits only: the rows are independent, the others are served
                assert rows is not None
                bad[ln] = (f"decode failed: the logits are not finite (NaN or inf; row max "
                           f"{float(rows[ln, toks[ln]])})")
                toks[ln] = 0
            elif req.sampler is not None:
                assert rows is not None
                try:
                    toks[ln] = self._sample(req, rows[ln])
                except Exception as exc:  # noqa: BLE001
                    bad[ln] = f"sampler failed: {exc!r}"
        self.stats.decode_steps += 1
        self.stats.decode_rows_padding += len(plan.padding)
        self._apply("decode", pad=plan.pad, lpad=plan.lpad, tok=tuple(int(t) for t in toks))
        for ln in lanes:
            if ln in bad:
                self._end(ln, events, bad[ln])
            else:
                self._emit_token(ln, int(toks[ln]), events)

    def _checked(self, tok: Any) -> int:
        """A token an engine sampled: an id in the vocabulary (else the next decode call
        would fail for every lane)."""
        tok = _token(tok)
        vocab = getattr(self.runtime, "vocab_size", None)
        if tok < 0 or vocab is not None and tok >= vocab:
            raise ValueError(f"token {tok} outside the vocabulary")
        return tok

    def _sample(self, req: Request, logits: Any) -> int:
        """The request's sampler's token, checked: a token outside the vocabulary would fail
        the next decode call for every lane."""
        tok = _token(req.sampler(logits))  # type: ignore[misc]
        vocab = logits.shape[-1]
        if not 0 <= tok < vocab:
            raise ValueError(f"token {tok} outside the vocabulary 0..{vocab - 1}")
        return tok
