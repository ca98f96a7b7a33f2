"""PD workers: a prefill worker and a decode worker talking over a `Transport`.

The decode worker owns the requests. Each is submitted to its batcher as `remote`: once it has a
lane and blocks for its whole prompt (an "import" event) the decode worker asks the prefill
worker for its KV with `{"kind": "prefill", "id", "nonce", "prompt"}`. The prefill worker
prefills it as an `export` request and answers with the payload (`{"kind": "kv", "nonce",
...}`, see `atom_core.pd.payload`) or with `{"kind": "prefill_failed", "id", "nonce", "error"}`. The
decode worker validates every payload before anything is written into a block; a bad one fails
that request alone. Meanwhile the other lanes
keep decoding: nothing waits for the transport except an idle loop. With `prefetch=N` the decode
worker also asks for the KV of the next N waiting requests before they get a lane and keeps it,
validated, in host memory until they do (the round trip then overlaps other requests' decode);
KV that arrives while its lane's table is still growing waits the same way.

A transport that asks another prefill worker for a request on its own (a cluster's links)
numbers its attempts (`attempt(wire)`): the request's transfer deadline (`transfer_timeout`)
counts from the latest one.

Other messages, decode -> prefill: `{"kind": "cancel", "id"}` (the request was aborted or timed
out: the prefill worker drops it and answers prefill_failed, so a block draining on the decode
side is freed) and `{"kind": "shutdown"}`.

For a hybrid (sliding-window) model the payload also carries the prefill lane's local ring, which
the decode worker requires (validated to its local slot's shape) and writes into its lane's slot.

Wire ids are the decode worker's request ids as strings; each request has at most one transfer,
so a message for an id whose transfer is over is late or duplicated: counted, never imported.
When the prefill worker is lost, transfers into a lane fail; requests holding no lane are
prefilled locally (`fallback_local`) or fail at once; prefetched KV that arrived is still used.
With a key (required unless `insecure=True`) the transport is wrapped in a
`secure_link.SecureLink`: a key handshake, then every message, control messages included, sealed and
bound to its session, direction, kind, request nonce and sequence number. Each prefill request
carries a fresh nonce that every answer (kv, prefill_failed) and cancel must echo: one that does
not is another request's and is dropped (`misdirected`). A message handler never raises into the
serving loop: a malformed message is counted (`bad_messages`) and dropped.

The single-thread simulation (tests) steps both workers alternately over an
`InProcessTransport.pair()`; two processes use `GlooTransport` (see `atom-core pd-prefill` and
`pd-decode`).
"""

from __future__ import annotations

import hmac
import itertools
import logging
import math
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import IO, Any

import attrs

from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event, Result
from atom_core.config import Config
from atom_core.pd import payload as pd
from atom_core.pd.links import wellformed_nonce, wellformed_prefill
from atom_core.pd.transport import Transport, TransportError
from atom_core.runtime.protocol import Capabilities

__all__ = ["DecodeWorker", "PrefillWorker"]

log = logging.getLogger(__name__)

LOST = "prefill worker lost"


# A transfer unanswered this long fails its request (and frees its lane): a silent peer must not
# hold lanes forever.
DEFAULT_TRANSFER_TIMEOUT = 30.0

NO_KEY = ("PD workers need a shared key (key=..., `atom_core.pd.payload.load_key`): without "
          "one any process that reaches the link can take the peer's place and read or inject "
          "KV, on loopback too (any local user can connect). Pass insecure=True only for tests "
          "on a machine you alone use")


def _need_key(key: bytes | None, insecure: bool) -> None:
    if key is None and not insecure:
        raise ValueError(NO_KEY)
    if key is None:
        # the explicit flag lets it run; the log says so, so an insecure deployment (a test
        # setting that reached production) is never silent
        log.warning("PD worker WITHOUT a key (insecure=True): its link is neither authenticated "
                    "nor encrypted, and any process that reaches it can read prompts and KV or "
                    "inject KV; give both workers a shared key (pd.load_key)")
    if key is not None and (not isinstance(key, bytes) or len(key) < pd.MIN_KEY_BYTES):
        raise ValueError(f"the PD key must be bytes of at least {pd.MIN_KEY_BYTES} "
                         "(pd.load_key)")


def _secure(transport: Transport, key: bytes | None, role: str, config: Config, runtime: Any,
            caps: Capabilities, tensors: bool, **link: Any) -> tuple[Transport, bytes | None]:
    """(the transport to use, the payload MAC key): with a key, a transport that is not secure
    already is wrapped in a `secure_link.SecureLink` (handshake, AEAD, replay window; boxes above
    this side's frame limits dropped unopened: `tensors` False takes headers only), and
    payloads carry an HMAC under a key derived for that purpose."""
    if key is None:
        return transport, None
    from atom_core.pd import secure_link  # needs `cryptography` (the pd extra)

    if not getattr(transport, "secure", False):
        lim = pd.frame_limits(config, runtime, caps)
        transport = secure_link.SecureLink(
            transport, key, role, **link,
            max_box_bytes=secure_link.box_limit(lim.header_bytes,
                                                lim.tensor_bytes if tensors else 0))
    return transport, secure_link.derive_key(key, "payload mac")


def _same_nonce(got: Any, want: str | None) -> bool:
    """`got` is the per-request nonce `want` (constant time)."""
    return want is not None and wellformed_nonce(got) and \
        hmac.compare_digest(got.encode(), want.encode())


def _send(transport: Transport, header: dict[str, Any]) -> bool:
    """Best-effort control message: False when the peer is already gone (its loss reaches the
    caller as a peer_lost message, which is where it is handled)."""
    try:
        transport.send(header)
    except TransportError:
        return False
    return True


# --------------------------------------------------------------------------- prefill side
@attrs.define
class PrefillStats:
    requests: int = 0
    exports: int = 0
    failures: int = 0  # reported to the decode worker as prefill_failed
    cancelled: int = 0
    ignored: int = 0  # duplicate or unknown-kind messages
    bad_messages: int = 0  # malformed: dropped (their handler raised nothing further)
    refused_busy: int = 0  # refused for backpressure (max_queued): answered busy


class PrefillWorker:
    """Prefills what the decode worker asks for and ships the KV back.

    `serve()` runs until the decode worker says shutdown or is lost; `step_once()` is one round
    (poll, one batcher step) for single-threaded drivers. `key`: sign every payload (HMAC) with
    this shared key (`pd.load_key`); required unless `insecure=True`."""

    def __init__(self, config: Config, runtime: Any, transport: Transport, *,
                 key: bytes | None = None, insecure: bool = False, ghost: bool = False,
                 max_queued: int | None = None, trace: IO[str] | None = None) -> None:
        """`max_queued`: prefill requests held at once (default: 4 per lane plus 16, above
        what a decode worker with a prefetch of a few per lane asks for); one more is answered
        prefill_failed at once (backpressure), so a peer cannot grow this worker's queue
        without bound. `trace`: the batcher's transitions as JSON lines (`atom-core
        check-trace` reads them; `simulate --html` draws them)."""
        _need_key(key, insecure)
        if max_queued is None:
            max_queued = 4 * config.lanes + 16
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 1:
            raise ValueError(f"max_queued must be a positive integer, got {max_queued!r}")
        self.max_queued = max_queued
        self.batcher = AtomBatcher(config, runtime, ghost=ghost, trace=trace)
        # it takes prefill requests and control messages, never a tensor
        caps = self.batcher.capabilities  # the runtime, as the batcher read it
        self.transport, self.key = _secure(transport, key, "prefill", config, runtime, caps,
                                           tensors=False)
        self.fingerprint = pd.model_fingerprint(runtime, caps)
        self.stats = PrefillStats()
        self.done = False
        self.ended_by: str | None = None  # "shutdown", or why the link ended
        self._wire: dict[int, str] = {}  # local request -> wire id
        self._local: dict[str, int] = {}  # wire id -> local request, while in flight
        self._nonce: dict[str, str] = {}  # wire id -> its request nonce, while in flight

    def serve(self, idle_wait: float = 0.5) -> None:
        while not self.done:
            if not self.step_once():
                self.transport.wait(idle_wait)  # wakes on the next message

    def step_once(self) -> bool:
        """One round; False when there was nothing to do."""
        msgs = self.transport.poll()
        for header, _tensor in msgs:
            try:
                self._on_message(header)
            except Exception:  # noqa: BLE001 - a bad message never stops the serving loop
                self.stats.bad_messages += 1
        if not msgs and not self.transport.alive and not self.done:
            # killed or closed on this side: no peer_lost will come
            self.done, self.ended_by = True, "transport closed"
        if self.done:
            return False
        if not self.batcher.busy():
            return bool(msgs)
        for ev in self.batcher.step():
            self._on_event(ev)
        return True

    def _on_message(self, header: dict[str, Any]) -> None:
        kind = header.get("kind")
        if kind in ("shutdown", "peer_lost"):
            if not self.done:
                self.done = True
                self.ended_by = "shutdown" if kind == "shutdown" else \
                    f"decode worker lost: {header.get('error')}"
        elif kind == "prefill":
            self._on_prefill(header.get("id"), header.get("prompt"), header.get("nonce"))
        elif kind == "cancel":
            wire = header.get("id")
            rid = self._local.get(wire) if isinstance(wire, str) else None
            if rid is not None and not _same_nonce(header.get("nonce"), self._nonce.get(wire)):
                rid = None  # a cancel of another request (or of an earlier one of this id)
            if rid is not None and self.batcher.abort(rid):
                self.stats.cancelled += 1
                # The decode side may hold a block draining for this transfer: end it.
                self._fail(rid, "cancelled by the decode worker")
            else:
                self.stats.ignored += 1  # its KV (or failure) is already on the way
        else:
            self.stats.ignored += 1

    def _on_prefill(self, wire: Any, prompt: Any, nonce: Any) -> None:
        if not wellformed_prefill(wire, nonce) or wire in self._local:
            # No id or nonce to answer with, or a duplicate: answering would fail the original
            # request.
            self.stats.ignored += 1
            return
        self.stats.requests += 1
        busy = len(self._local) >= self.max_queued
        try:
            if busy:
                raise ValueError(f"it holds {len(self._local)} requests already (max_queued); "
                                 "ask again once some are answered")
            if not isinstance(prompt, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("prompt must be a list of integer token ids")
            rid = self.batcher.submit(prompt, 1, export=True)
        except Exception as exc:  # noqa: BLE001 - refuse this request, keep serving
            self.stats.failures += 1
            self.stats.refused_busy += busy
            # "busy": refused for backpressure alone, nothing wrong with the request: the
            # decode side may ask another prefill worker or prefill it locally
            _send(self.transport, {"kind": "prefill_failed", "id": wire, "nonce": nonce,
                                   "error": f"prefill worker refused the request: {exc}",
                                   "busy": busy})
            return
        self._wire[rid] = wire
        self._local[wire] = rid
        self._nonce[wire] = nonce

    def _on_event(self, ev: Event) -> None:
        rid = ev.request_id
        if ev.kind == "export":
            self._export(rid)
        elif ev.kind == "error":
            self._fail(rid, f"prefill failed: {ev.error}")
        elif ev.kind == "finished":
            self._forget(rid)

    def _export(self, rid: int) -> None:
        wire = self._wire[rid]
        try:
            exp = self.batcher.take_export(rid)
            payload = pd.make_payload(wire, exp.prompt, exp.first_token, exp.host,
                                      self.fingerprint, self.key, local_host=exp.local_host)
            header, kv = pd.to_wire(payload)
            # send copies the tensor, so the block may be released as soon as it returns
            self.transport.send({**header, "kind": "kv", "nonce": self._nonce[wire]}, kv)
        except Exception as exc:  # noqa: BLE001 - this export failed, the worker goes on
            for ev in self.batcher.export_done(rid, f"export failed: {exc!r}"):
                self._on_event(ev)
            return
        self.stats.exports += 1
        for ev in self.batcher.export_done(rid):
            self._on_event(ev)

    def _fail(self, rid: int, error: str) -> None:
        wire = self._wire.get(rid)
        if wire is None:
            return
        self.stats.failures += 1
        _send(self.transport, {"kind": "prefill_failed", "id": wire,
                               "nonce": self._nonce.get(wire, ""), "error": error})
        self._forget(rid)

    def _forget(self, rid: int) -> None:
        wire = self._wire.pop(rid, None)
        if wire is not None:
            self._local.pop(wire, None)
            self._nonce.pop(wire, None)


# --------------------------------------------------------------------------- decode side
@attrs.define
class _Req:
    """A request as the decode worker's caller sees it. `brid` is its id in the batcher; a
    request served by local prefill after the prefill worker was lost gets a new one."""

    prompt: list[int]
    max_new_tokens: int
    eos: int | None
    brid: int | None
    t_submit: float
    wire: str | None = None  # set once its prefill request is sent
    nonce: str | None = None  # fresh per prefill request; every answer must echo it
    t_sent: float | None = None  # when its latest attempt was sent
    attempt: int = 0  # the transport's attempt that t_sent times (see DecodeWorker._expire)
    answered: bool = False  # its KV (or a failure) arrived
    payload: pd.KVPayload | None = None  # prefetched KV, validated, until it gets a lane
    t_first: float | None = None
    t_end: float | None = None
    error: str | None = None  # set when the worker ended it without the batcher
    kind: str | None = None  # why it failed, for the summary


class DecodeWorker:
    """Decodes requests whose prompt KV a prefill worker computes (see the module docstring).

    `key`: the shared key (required unless `insecure=True`): every payload must carry a valid
    HMAC under it. `fallback_local`: when
    the prefill worker is lost, requests it has not answered and that hold no lane yet (and new
    ones) are prefilled here. `transfer_timeout`: a transfer unanswered for this many seconds
    ends (the request fails; a draining block is freed); finite, 30 s by default. It is per
    attempt: when the transport asks another prefill worker (a cluster's links, after a loss,
    a refusal or a hang: its `attempt(wire)` grows) the clock starts again.
    `prefetch`: ask for the KV of up to this many waiting requests before they get a lane, and
    keep what arrives (validated, in host memory: at most `prefetch` prompts' KV) until they
    do; 0 asks only once a lane and a block wait for it. Prefetching takes the prefill round
    trip off the lane's critical path."""

    def __init__(self, config: Config, runtime: Any, transport: Transport, *,
                 key: bytes | None = None, insecure: bool = False, fallback_local: bool = True,
                 transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT, prefetch: int = 0,
                 ghost: bool = False,
                 clock: Callable[[], float] = time.perf_counter,
                 keep_ended: int | None = 10_000, wire_prefix: str = "",
                 trace: IO[str] | None = None) -> None:
        """`ghost`: the batcher keeps ghost state (for invariant checks). `clock`: the time
        source of latencies and transfer timeouts (a simulation passes its own). `keep_ended`:
        how many ended requests `results()` and `summary()` still report; older ones are
        forgotten here and in the batcher (None: every one), so a long-running worker's memory
        does not grow with the requests it served. `wire_prefix`: put before every wire id, so
        that the ids of several decode workers sharing a prefill worker never collide (the
        cluster's; at most 32 characters). `trace`: as the prefill worker's."""
        _need_key(key, insecure)
        if not isinstance(wire_prefix, str) or len(wire_prefix) > 32:
            raise ValueError(f"wire_prefix must be a string of at most 32 characters, got "
                             f"{wire_prefix!r}")
        self.wire_prefix = wire_prefix
        if keep_ended is not None and (isinstance(keep_ended, bool)
                                       or not isinstance(keep_ended, int) or keep_ended < 0):
            raise ValueError(f"keep_ended must be an integer >= 0 or None, got {keep_ended!r}")
        self.keep_ended = keep_ended
        self._ended: deque[int] = deque()  # worker ids, in the order they ended
        self._next_wid = 0
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}")
        if isinstance(transfer_timeout, bool) or not isinstance(transfer_timeout, int | float) \
                or not math.isfinite(transfer_timeout) or transfer_timeout <= 0:
            raise ValueError(f"transfer_timeout must be finite positive seconds, got "
                             f"{transfer_timeout!r}: a silent peer must not hold lanes forever")
        # (the worker forgets the batcher's entries itself: results() reads them by its ids)
        self.batcher = AtomBatcher(config, runtime, ghost=ghost, keep_ended=None, trace=trace)
        self.clock = clock
        self.runtime = runtime
        # what the runtime is, as its batcher read it once (never its attributes again)
        self.capabilities = caps = self.batcher.capabilities
        self.transport, self.key = _secure(transport, key, "decode", config, runtime, caps,
                                           tensors=True, clock=clock)
        self.fallback_local = fallback_local
        # a transport that asks again on its own numbers each request's attempts (a cluster's
        # PrefillLinks); a pair's asks once
        self._attempt: Callable[[str], int] | None = getattr(self.transport, "attempt", None)
        self.transfer_timeout, self.prefetch = transfer_timeout, prefetch
        self.fingerprint = pd.model_fingerprint(runtime, caps)
        # One host tensor for every import, a whole table long: import_kv writes it into the
        # lane's blocks before returning.
        self._host = self.batcher.new_import_buffer()
        self._layout = pd.layout_of(self._host)
        self._dtype = pd.dtype_name(self._host.dtype)
        # hybrid: every payload must carry the sliding-window ring of exactly this local slot
        self._local_layout = None if config.sliding_window is None else tuple(
            int(d) for d in runtime.new_local_host_buffer().shape)
        self.requests: dict[int, _Req] = {}
        self._by_brid: dict[int, int] = {}
        self._by_wire: dict[str, int] = {}
        self.lost: str | None = None  # why the prefill worker is gone
        self.payload_errors: Counter[str] = Counter()  # by PayloadError.field
        self.auth_failures = 0
        self.stale_messages = 0  # late, duplicate or unknown: ignored
        self.bad_messages = 0  # malformed: dropped without touching any request
        self.misdirected = 0  # an answer without its request's nonce: dropped
        self.drained = 0  # late answers that freed a block draining after an abort
        self.local_fallbacks = 0
        self.overlapped_steps = 0  # decode calls made while a transfer was outstanding
        self._progress = False

    # ------------------------------------------------------------------ client API
    def submit(self, prompt: Iterable[int], max_new_tokens: int,
               eos: int | None = None, *, local: bool = False) -> int:
        """Queue a request; its KV comes from the prefill worker (or from local prefill once
        that worker is lost, with fallback_local; or with `local`: prefilled here whatever the
        prefill worker's state). Raises ValueError like `AtomBatcher.submit`."""
        prompt = list(prompt)
        wid = self._next_wid
        req = _Req(prompt, max_new_tokens, eos, None, self.clock())
        if self.lost is not None and not self.fallback_local and not local:
            # Nothing can prefill it: it fails now instead of waiting forever.
            req.error = f"{LOST}: {self.lost}; not served (no local fallback)"
            req.kind, req.t_end = "peer_lost", req.t_submit
        else:
            req.brid = self.batcher.submit(prompt, max_new_tokens, eos,
                                           remote=self.lost is None and not local)
            self._by_brid[req.brid] = wid
        self._next_wid += 1
        self.requests[wid] = req
        if req.t_end is not None:
            self._ended_now(wid)
        return wid

    def abort(self, wid: int) -> bool:
        """End a request early; False for unknown or ended ones. A transfer in flight is
        cancelled; a block waiting for it stays draining until the prefill worker answers."""
        req = self.requests.get(wid)
        if req is None or req.brid is None:
            return False
        if not self.batcher.abort(req.brid):
            return False
        req.t_end, req.kind, req.payload = self.clock(), "aborted", None
        self._ended_now(wid)
        if req.wire is not None and not req.answered:
            _send(self.transport, {"kind": "cancel", "id": req.wire, "nonce": req.nonce})
        return True

    def busy(self) -> bool:
        return self.batcher.busy()

    def step(self) -> list[Event]:
        """Handle what arrived, then one batcher step. Events carry this worker's request ids."""
        out: list[Event] = []
        self._progress = False
        for header, tensor in self.transport.poll():
            self._progress = True
            try:
                self._on_message(header, tensor, out)
            except Exception:  # noqa: BLE001 - a bad message never stops the serving loop
                self.bad_messages += 1
        self._expire(out)
        st = self.batcher.stats
        in_flight = self._in_flight()
        before = (st.decode_steps, st.prefill_tokens)
        events = self.batcher.step()
        if st.decode_steps > before[0] and in_flight:
            self.overlapped_steps += 1
        if events or (st.decode_steps, st.prefill_tokens) != before:
            self._progress = True
        self._handle(events, out)
        self._prefetch(out)
        self._trim_ended()
        return out

    def _ended_now(self, wid: int) -> None:
        self._ended.append(wid)

    def _trim_ended(self) -> None:
        """Forget the oldest ended requests past `keep_ended` (after the step that reported
        them). One whose blocks still drain holds back the rest until its transfer ends."""
        if self.keep_ended is None:
            return
        while len(self._ended) > self.keep_ended:
            wid = self._ended[0]
            req = self.requests[wid]
            if req.brid is not None and not self.batcher.forget(req.brid):
                return
            self._ended.popleft()
            del self.requests[wid]
            if req.brid is not None:
                self._by_brid.pop(req.brid, None)
            if req.wire is not None:  # a late answer for it is now unknown: stale
                self._by_wire.pop(req.wire, None)

    def run_until_done(self, timeout: float | None = None,
                       idle_wait: float = 0.05) -> dict[int, Result]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.busy():
            self.step()
            if not self._progress:
                self.transport.wait(idle_wait)  # nothing to compute: sleep until a message
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"requests still running after {timeout}s: "
                                   f"{sorted(self._unfinished())}")
        return self.results()

    def results(self) -> dict[int, Result]:
        out = {}
        for wid, req in self.requests.items():
            r = self.batcher.requests[req.brid] if req.brid is not None else None
            tokens = list(r.tokens) if r is not None else []
            error = req.error or (r.error if r is not None else None)
            out[wid] = Result(tokens, error)
        return out

    def close(self) -> None:
        """Tell the prefill worker to stop, then close the transport."""
        if self.transport.alive:
            _send(self.transport, {"kind": "shutdown"})
        self.transport.close()

    def __enter__(self) -> DecodeWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def summary(self) -> dict[str, Any]:
        results = self.results()
        failed = {wid for wid, r in results.items() if r.error is not None}
        kinds = Counter(self.requests[w].kind or "runtime" for w in failed)
        ended = [r for r in self.requests.values() if r.t_end is not None]
        lat = sorted(r.t_end - r.t_submit for r in ended)  # type: ignore[operator]
        ttft = sorted(r.t_first - r.t_submit for r in self.requests.values()
                      if r.t_first is not None)
        wall = (max(r.t_end for r in ended) - min(r.t_submit for r in self.requests.values())
                if ended else 0.0)  # type: ignore[type-var]
        st, ts = self.batcher.stats, self.transport.stats
        return {
            "requests": len(results),
            "completed": len(results) - len(failed),
            "failed": len(failed),
            "errors_by_kind": dict(sorted(kinds.items())),
            "generated_tokens": st.generated_tokens,
            "imported_tokens": st.imported_tokens,
            "local_prefill_tokens": st.prefill_tokens,
            "local_fallbacks": self.local_fallbacks,
            "auth_failures": self.auth_failures,
            "payload_errors": dict(sorted(self.payload_errors.items())),
            "stale_messages": self.stale_messages,
            "bad_messages": self.bad_messages,
            "misdirected": self.misdirected,
            "link_dropped": dict(sorted(getattr(self.transport, "dropped", {}).items())),
            "bytes_received": ts["bytes_received"],
            "bytes_sent": ts["bytes_sent"],
            "prefetch": self.prefetch,
            "decode_steps": st.decode_steps,
            "decode_steps_overlapped": self.overlapped_steps,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(st.generated_tokens / wall, 1) if wall > 0 else None,
            "latency_median_s": quantile(lat, 0.5),
            "latency_p90_s": quantile(lat, 0.9),
            "ttft_median_s": quantile(ttft, 0.5),
        }

    # ------------------------------------------------------------------ messages
    def _on_message(self, header: dict[str, Any], tensor: Any, out: list[Event]) -> None:
        kind = header.get("kind")
        if kind == "peer_lost":
            self._on_lost(str(header.get("error")), out)
            return
        if kind not in ("kv", "prefill_failed"):
            self.stale_messages += 1
            return
        wire = header.get("request_id" if kind == "kv" else "id")
        wid = self._by_wire.get(wire) if isinstance(wire, str) else None
        if wid is None:
            self.stale_messages += 1
            return
        req = self.requests[wid]
        assert req.brid is not None
        if not _same_nonce(header.get("nonce"), req.nonce):
            # an answer to another request (or to an earlier life of this id): not this one's
            self.misdirected += 1
            return
        phase = self.batcher.phase(req.brid)
        if req.answered or phase not in (core.PHASE_IMPORTING, core.PHASE_WAITING):
            # Late or duplicate: ends the transfer of a block draining after an abort, if any.
            self._end_transfer(req.brid, "late answer", out)
            return
        if kind == "prefill_failed":
            why = header.get("error")
            # the peer's text, bounded and printable: it ends up in results and logs
            why = ascii(why)[:300] if not isinstance(why, str) else ascii(why)[1:-1][:300]
            # refused for backpressure alone ("busy"): a cluster's node prefills it locally
            self._fail(wid, "prefill_busy" if header.get("busy") is True else "prefill_failed",
                       f"the prefill worker failed this request: {why}", out)
            return
        try:
            payload = pd.from_wire(header, tensor)
            pd.validate(payload, request_id=wire, prompt=req.prompt,
                        fingerprint=self.fingerprint, layout=self._layout, dtype=self._dtype,
                        vocab_size=self.capabilities.vocab_size, key=self.key,
                        local_layout=self._local_layout)
        except pd.PayloadError as exc:
            self.payload_errors[exc.field] += 1
            if exc.field == "mac":
                self.auth_failures += 1
            self._fail(wid, f"payload:{exc.field}", f"KV payload rejected ({exc.field}): {exc}",
                       out)
            return
        req.answered, req.payload = True, payload
        if self.batcher.awaits_kv(req.brid):
            self._import(wid, out)
        # else prefetched: it waits, validated, for its lane (and its whole table: the import
        # event, `_on_import`)

    def _import(self, wid: int, out: list[Event]) -> None:
        req = self.requests[wid]
        payload, req.payload = req.payload, None
        assert payload is not None and req.brid is not None
        host = pd.write_into(payload, self._host)
        # local_kv (hybrid) goes in as received: validated to be exactly the local slot's shape
        # and dtype, and update_local_cache copies it before import_kv returns
        self._handle(self.batcher.import_kv(req.brid, payload.prompt, payload.first_token,
                                            host, local_kv=payload.local_kv), out)

    def _fail(self, wid: int, kind: str, error: str, out: list[Event]) -> None:
        """`wid`'s transfer ended without usable KV: it fails, holding a lane or not."""
        req = self.requests[wid]
        assert req.brid is not None
        req.kind, req.answered, req.payload = kind, True, None
        if self._importing(req.brid):
            self._handle(self.batcher.transfer_ended(req.brid, error), out)
        elif self.batcher.abort(req.brid):  # prefetched, still waiting: no block to free
            req.error, req.t_end = error, self.clock()
            self._ended_now(wid)
            out.append(Event("error", wid, error=error))

    def _on_lost(self, why: str, out: list[Event]) -> None:
        if self.lost is not None:
            return
        self.lost = why
        for brid in list(self.batcher.transfers()):
            wid = self._by_brid[brid]
            if self._importing(brid):
                self._fail(wid, "peer_lost", f"{LOST}: {why}; the KV of this request was in "
                           "flight", out)
            else:
                self._end_transfer(brid, f"{LOST}: {why}", out)
        # Waiting requests whose KV did not arrive hold no block: prefill them here, or fail
        # them now rather than let them wait for a worker that is gone. Prefetched KV that did
        # arrive is still good and is imported when the request gets a lane.
        for brid in list(self.batcher.waiting):
            wid = self._by_brid[brid]
            req = self.requests[wid]
            if not self.batcher.requests[brid].remote or req.payload is not None:
                continue
            req.answered = True  # whatever it was asked for will never come
            if self.fallback_local:
                self.batcher.make_local(brid)
                self.local_fallbacks += 1
            else:
                self.batcher.abort(brid)
                req.error = f"{LOST}: {why}; not served (no local fallback)"
                req.kind, req.t_end = "peer_lost", self.clock()
                self._ended_now(wid)
                out.append(Event("error", wid, error=req.error))

    def _expire(self, out: list[Event]) -> None:
        now = self.clock()
        msg = f"the prefill worker did not answer within {self.transfer_timeout:g}s"
        for brid in [*self.batcher.transfers(), *self._next_waiting()]:
            wid = self._by_brid.get(brid)
            req = self.requests[wid] if wid is not None else None
            if req is None or req.t_sent is None or req.answered or self._retried(req, now) \
                    or now - req.t_sent < self.transfer_timeout:
                continue
            if self._importing(brid) or self.batcher.phase(brid) == \
                    core.PHASE_WAITING:
                self._fail(wid, "timeout", msg, out)  # type: ignore[arg-type]
                _send(self.transport, {"kind": "cancel", "id": req.wire, "nonce": req.nonce})
            else:
                req.answered = True
                self._end_transfer(brid, msg, out)

    def _retried(self, req: _Req, now: float) -> bool:
        """The transport asked again for `req` since it was last timed (its first worker was
        lost, full or hung): the deadline counts from now, the retry's own (seen at most a
        step after it was sent, which only gives it that step more)."""
        if self._attempt is None or req.wire is None:
            return False
        n = self._attempt(req.wire)
        if n <= req.attempt:
            return False  # (0: not waiting there any more; the worker's own events end it)
        req.attempt, req.t_sent = n, now
        return True

    def _end_transfer(self, brid: int, why: str, out: list[Event]) -> None:
        """A transfer of an ended request is over: frees its draining block, else stale."""
        stale = self.batcher.stats.stale_events
        self._handle(self.batcher.transfer_ended(brid, why), out)
        if self.batcher.stats.stale_events > stale:
            self.stale_messages += 1
        else:
            self.drained += 1

    # ------------------------------------------------------------------ batcher events
    def _handle(self, events: list[Event], out: list[Event]) -> None:
        now = self.clock()
        for ev in events:
            wid = self._by_brid.get(ev.request_id)
            if wid is None:
                continue
            req = self.requests[wid]
            if ev.kind == "import":
                self._on_import(wid, out)
                continue
            if ev.kind == "token" and req.t_first is None:
                req.t_first = now
            elif ev.kind in ("finished", "error"):
                req.t_end = now
                self._ended_now(wid)
            out.append(Event(ev.kind, wid, ev.token, ev.error))

    def _on_import(self, wid: int, out: list[Event]) -> None:
        """`wid` got a lane and a block: import its prefetched KV, or ask for it."""
        req = self.requests[wid]
        assert req.brid is not None
        if not self._importing(req.brid):
            return  # ended meanwhile (a loss handled earlier in this batch)
        if req.payload is not None:
            self._import(wid, out)
        elif self.lost is not None:
            self._fail(wid, "peer_lost", f"{LOST}: {self.lost}", out)
        elif req.wire is None:
            self._send_prefill(wid, out)
        # else: prefetched, its answer is on the way

    def _send_prefill(self, wid: int, out: list[Event]) -> None:
        req = self.requests[wid]
        req.wire, req.t_sent = f"{self.wire_prefix}{wid}", self.clock()
        req.nonce = secrets.token_hex(16)
        self._by_wire[req.wire] = wid
        try:
            self.transport.send({"kind": "prefill", "id": req.wire, "nonce": req.nonce,
                                 "prompt": req.prompt})
        except TransportError as exc:
            self._on_lost(str(exc), out)
            return
        if self._attempt is not None:
            req.attempt = self._attempt(req.wire)  # t_sent times this one

    def _prefetch(self, out: list[Event]) -> None:
        """Ask for the KV of the first `prefetch` waiting requests (FIFO: admission order)."""
        for brid in self._next_waiting():
            if self.lost is not None:
                return
            wid = self._by_brid[brid]
            if self.requests[wid].wire is None and self.batcher.requests[brid].remote:
                self._send_prefill(wid, out)

    # ------------------------------------------------------------------ helpers
    def _importing(self, brid: int) -> bool:
        return self.batcher.phase(brid) == core.PHASE_IMPORTING

    def _next_waiting(self) -> list[int]:
        """The waiting requests prefetching covers: the next `prefetch` to be admitted."""
        return list(itertools.islice(self.batcher.waiting, self.prefetch))

    def _in_flight(self) -> bool:
        """Some KV was asked for and has not arrived (for a lane, or prefetched)."""
        asked = [b for b in self.batcher.transfers() if self._importing(b)]
        for brid in asked + self._next_waiting():
            req = self.requests[self._by_brid[brid]]
            if req.wire is not None and not req.answered:
                return True
        return False

    def _unfinished(self) -> list[int]:
        return [w for w, r in self.requests.items()
                if r.brid is not None and not self.batcher.requests[r.brid].ended]


def quantile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (no interpolation: with few requests it names a real one)."""
    if not sorted_values:
        return None
    return round(sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)], 4)
