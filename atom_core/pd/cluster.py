"""A PD cluster: N prefill workers, M decode workers and a router (`Frontend`).

Each worker is a node: one PD worker (atom_core/pd/workers.py, unchanged), its links to the
workers of the other role (atom_core/pd/links.py) and a control link to the frontend. Every link is
its own authenticated `SecureLink` when there is a key (required unless `insecure=True`).

Control messages (frontend <-> node), none carrying a tensor:

- frontend -> decode node: `{"kind": "request", "id", "prompt", "max_new_tokens", "eos",
  "prefill"}` (the router's choices: this node, and the prefill worker to ask or None), `{"kind":
  "abort", "id"}`, `{"kind": "prefill_ready", "ranks", "gens"}` (the prefill workers that
  reported ready and the generation of each that did, whenever that changes: the only ones the
  node asks, retries included, and only over a link to that generation; "unresponsive":
  [[rank, gen], ...], ready ones left out of "ranks" because a decode node reports them as not
  answering: the node moves what it asked of them elsewhere at once); to every node:
  `{"kind": "shutdown"}`.
- node -> frontend: `{"kind": "load", "load": Load, "stats": {...}, "gen"}` whenever it
  changed (the first ready one makes the worker eligible; the stats feed
  `Frontend.worker_stats`; "gen" is the node's generation, when it knows it; a decode node's
  also has "unresponsive": [[rank, gen], ...], the prefill workers it takes for hung, sent at
  once when that changes: the router sets them aside until no decode node reports them; a
  report without it reports none), and from a decode node `{"kind": "events", "events":
  [[id, kind, token, error], ...]}` per step.

Faults. A prefill worker that is lost: its unanswered requests go to another prefill worker
(`PrefillLinks`), or, with none left, to local prefill on their decode worker: those waiting
for a lane are made local by the decode worker itself, those holding one (their transfer
failed; no token was produced yet) are resubmitted locally here, so each still ends once. A
prefill worker that lets a request time out is taken for hung by that decode node's links
(asked nothing until it answers again, `PrefillLinks.timed_out`): the request is resubmitted
(to another prefill worker once, else locally) and the worker's other unanswered requests
are asked again elsewhere; the node's stats count it (`prefill_timeouts`,
`unresponsive_prefill`, `unresponsive_prefill_ranks`). The node reports it to the frontend,
whose router chooses it no more, and whose ready lists leave it out and name it unresponsive
to the other decode nodes (they move what they asked of it at once, instead of each waiting
for its own deadline), until no decode node reports it: it answered the one that saw it hang
(that one's ping), or restarted (a report names a process generation: an older process's hang
says nothing about the new one), or that decode node was lost. A
decode worker that is lost: the frontend fails its unfinished requests with an error naming it,
and nothing else changes. A worker that starts late or restarts is used once it reports ready
(`Frontend.add`, `PrefillLinks.add`). A worker whose control message is not a report
(`parse_report` checks every field of every kind before anything is taken: a token that is
no id of the vocabulary, an unknown kind, a missing field...) is taken for faulty: one log
line says which and why, it is lost as above, told to stop and its control link closed
(`Frontend.faulty`); the frontend goes on serving the others.

`LocalCluster` runs all of it in one thread over `InProcessTransport` pairs (tests, bench);
`atom-core pd-cluster` (atom_core/pd/cluster_run.py) runs one process per worker over gloo.
"""

from __future__ import annotations

import json
import logging
import math
import reprlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from atom_core.config import Config
from atom_core.pd.links import DecodeLinks, PrefillLinks, poll_until, try_send
from atom_core.pd.payload import is_int
from atom_core.pd.router import Load, Policy, Router, load_of
from atom_core.pd.transport import PEER_LOST, InProcessTransport, Transport
from atom_core.pd.workers import DecodeWorker, PrefillWorker, quantile

__all__ = ["ClusterResult", "DecodeNode", "EventRow", "EventsReport", "Frontend", "LoadReport",
           "LocalCluster", "LostReport", "PrefillNode", "ReportError", "parse_report"]

log = logging.getLogger(__name__)

# The largest control message a link takes (a request carries its prompt, a step's events one
# token per lane): far above either, far below anything that could exhaust memory.
CONTROL_BYTES = 1 << 20


def prefix_unit(cfg: Config) -> int:
    """The granularity at which `cfg`'s prefix cache hits: one chunk with one block per table,
    else one block."""
    return cfg.prefill_chunk if cfg.blocks_per_table == 1 else cfg.block_size




def _stats_of(batcher: Any) -> dict[str, int]:
    st = batcher.stats
    return {"prefill_tokens": st.prefill_tokens, "prefix_hit_tokens": st.prefix_hit_tokens,
            "imported_tokens": st.imported_tokens, "generated_tokens": st.generated_tokens,
            "exports": st.exports}


# The most prefill workers a report, or a ready list, names as not answering: a longer list is
# malformed (no cluster has that many prefill workers).
MAX_UNRESPONSIVE = 4096


def rank_gens(obj: Any) -> dict[int, int | None]:
    """[[rank, generation or None], ...] from a peer's message, as rank -> generation;
    ValueError if it is not one (it comes from the wire: checked, never trusted blindly)."""
    if not isinstance(obj, list) or len(obj) > MAX_UNRESPONSIVE or not all(
            isinstance(e, list) and len(e) == 2 and is_int(e[0]) and 0 <= e[0] < 2 ** 31
            and (e[1] is None or is_int(e[1])) for e in obj):
        raise ValueError(f"a list of [rank, generation] pairs, got {obj!r}"[:200])
    return {e[0]: e[1] for e in obj}


# --------------------------------------------------------------------------- reports
class ReportError(ValueError):
    """A worker's control message is not a report the frontend takes from it (the message
    says which field was wrong and how): nothing of it is taken, and the frontend takes that
    worker for faulty (`Frontend`)."""


# What a decode node reports of a request: a token, its end, or a preemption (it resumes where
# it stopped: nothing to do here).
EVENT_KINDS = frozenset(("token", "finished", "error", "preempted"))
# The most rows one events report holds: a decode worker's step yields a token per lane and
# an end per request it ends, far fewer; a longer list is malformed.
MAX_EVENTS = 1 << 16
# The most counters a load report's stats hold, and the longest name of one (ours: about 20
# names of about 25 characters).
MAX_STATS = 256
MAX_STAT_NAME = 128
# Token ids when the vocabulary is not known: what `Frontend.submit` takes in a prompt.
TOKEN_LIMIT = 2 ** 31


@attrs.frozen
class LoadReport:
    """`{"kind": "load", "load", "stats", "gen"?, "unresponsive"?}`: `hung` is a decode
    node's prefill workers taken for hung (rank -> generation; none when it names none), None
    for a prefill node (its message has no such field)."""

    load: Load
    stats: dict[str, Any]
    gen: int | None
    hung: dict[int, int | None] | None


@attrs.frozen
class EventRow:
    """One row `[cid, kind, token, error]` of an events report: `token` is set exactly for
    a "token" row, `error` exactly for an "error" row."""

    cid: int
    kind: str
    token: int | None
    error: str | None


@attrs.frozen
class EventsReport:
    """`{"kind": "events", "events": [[cid, kind, token, error], ...]}` (decode nodes only)."""

    events: tuple[EventRow, ...]


@attrs.frozen
class LostReport:
    """The control link's own report that the worker is gone (`PEER_LOST`)."""

    why: str


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60


def _shown(v: Any) -> str:
    """`v` for a message: bounded in length and depth whatever the peer sent, on one line."""
    try:
        return _repr.repr(v)
    except Exception:  # noqa: BLE001 - (an int past str's digit limit)
        return f"<{type(v).__name__}>"


def parse_report(role: str, header: Any, *, vocab_size: int | None = None,
                 issued: int = 2 ** 63) -> LoadReport | EventsReport | LostReport:
    """A `role` worker's control message as the record of its kind; ReportError naming the
    first bad field otherwise (never anything else, whatever the message holds: it comes
    from the wire). Every field the frontend reads is checked here, before anything is taken
    from the message, so a report is taken whole or not at all. `vocab_size`: the workers'
    vocabulary, which a token must be in (None: unknown, any id below 2**31); `issued`: the
    request ids issued so far (an event's id must be one of them). Fields the frontend does not
    read are ignored (a newer node may send more)."""
    if not isinstance(header, dict):
        raise ReportError(f"a report is an object, got {_shown(header)}")
    kind = header.get("kind")
    if kind == PEER_LOST:
        why = header.get("error")
        return LostReport(why if isinstance(why, str) else "its link was lost")
    if kind == "load":
        return _parse_load(role, header)
    if kind == "events" and role == "decode":
        return EventsReport(_parse_events(header.get("events"), vocab_size, issued))
    raise ReportError(f"a {role} worker sends no report of kind {_shown(kind)}")


def _parse_load(role: str, h: dict[str, Any]) -> LoadReport:
    try:
        load = Load.from_json(h.get("load"))
        hung = rank_gens(h.get("unresponsive", [])) if role == "decode" else None
    except ValueError as exc:
        raise ReportError(f"load report: {exc}") from None
    gen = h.get("gen")
    if gen is not None and not (is_int(gen) and 0 <= gen < 2 ** 63):
        raise ReportError(f"load report: gen is {_shown(gen)}, not a generation (an integer)")
    stats = h.get("stats")
    if not isinstance(stats, dict) or len(stats) > MAX_STATS:
        raise ReportError(f"load report: stats is {_shown(stats)}, not an object of at most "
                          f"{MAX_STATS} counters")
    for name, v in stats.items():
        if not (isinstance(name, str) and len(name) <= MAX_STAT_NAME and _stat_value(v)):
            raise ReportError(f"load report: stat {_shown(name)} is {_shown(v)}, not a count, "
                              "a finite measure or a list of ranks")
    return LoadReport(load, dict(stats), gen, hung)


def _stat_value(v: Any) -> bool:
    """A counter, a finite measure, or a list of ranks (`unresponsive_prefill_ranks`)."""
    if is_int(v):
        return 0 <= v < 2 ** 63
    if isinstance(v, float):
        return math.isfinite(v)  # (Infinity would reach the CLI's JSON output as is)
    return isinstance(v, list) and len(v) <= MAX_UNRESPONSIVE and all(
        is_int(r) and 0 <= r < 2 ** 31 for r in v)


def _parse_events(rows: Any, vocab_size: int | None, issued: int) -> tuple[EventRow, ...]:
    if not isinstance(rows, list) or len(rows) > MAX_EVENTS:
        raise ReportError(f"events report: events is {_shown(rows)}, not a list of at most "
                          f"{MAX_EVENTS} rows")
    limit = TOKEN_LIMIT if vocab_size is None else vocab_size
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 4:
            raise ReportError(f"events report: row {i} is {_shown(row)}, not [request id, "
                              "kind, token, error]")
        cid, kind, token, error = row
        if not (is_int(cid) and 0 <= cid < issued):
            raise ReportError(f"events report: row {i} names request {_shown(cid)}, which was "
                              "never issued")
        if not (isinstance(kind, str) and kind in EVENT_KINDS):
            raise ReportError(f"events report: row {i} is of kind {_shown(kind)}, not one of "
                              f"{sorted(EVENT_KINDS)}")
        if kind == "token":
            if not (is_int(token) and 0 <= token < limit):
                raise ReportError(f"events report: row {i} (request {cid}) has token "
                                  f"{_shown(token)}, not a token id in 0..{limit - 1}")
        elif token is not None:
            raise ReportError(f"events report: row {i} (request {cid}, {kind}) carries token "
                              f"{_shown(token)}; only a token row does")
        if kind == "error" and not isinstance(error, str) or kind != "error" and \
                error is not None:
            raise ReportError(f"events report: row {i} (request {cid}, {kind}) has error "
                              f"{_shown(error)}; an error row carries a message, no other does")
        out.append(EventRow(cid, kind, token, error))
    return tuple(out)


# Counters alone (no change of load) are reported at most this often: a decode worker's change
# every step, and the router only needs the load at once.
STATS_EVERY = 0.05


class _Reporter:
    """Sends a node's load report when the load changed, or the node took new requests since
    its last report (`took`: the router counted them in its load when it assigned them, and
    only a report corrects that count, even when taking them left the load as it was), or the
    prefill workers it takes for hung changed (`hung`: the router avoids them at once), or its
    counters changed and STATS_EVERY passed (on `clock`) since the last report."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._load: dict[str, Any] | None = None
        self._stats: dict[str, Any] | None = None
        self._at = 0.0
        self._took = 0
        self._hung: list[list[int | None]] | None = None
        self.clock = clock

    def report(self, control: Transport, load: Load, stats: dict[str, Any],
               took: int = 0, gen: int | None = None,
               hung: list[list[int | None]] | None = None) -> None:
        """`hung`: a decode node's prefill workers taken for hung ([rank, gen] each), None for
        a prefill node (its message has no such field)."""
        now = self.clock()
        ld = load.as_json()
        if ld == self._load and took == self._took and hung == self._hung and (
                stats == self._stats or now - self._at < STATS_EVERY):
            return
        msg: dict[str, Any] = {"kind": "load", "load": ld, "stats": stats}
        if gen is not None:
            msg["gen"] = gen
        if hung is not None:
            msg["unresponsive"] = hung
        if try_send(control, msg):
            self._load, self._stats, self._at, self._took = ld, stats, now, took
            self._hung = hung


# --------------------------------------------------------------------------- nodes
class DecodeNode:
    """A decode worker serving what the frontend sends it, its KV from the prefill workers."""

    def __init__(self, rank: int, worker: DecodeWorker, links: PrefillLinks,
                 control: Transport, clock: Callable[[], float] = time.monotonic,
                 gen: int | None = None) -> None:
        """`clock`: what paces reports of counters alone (a simulation passes its own).
        `gen`: this process's generation (reported with its load)."""
        if worker.transport is not links:
            raise ValueError("the decode worker must run over this node's PrefillLinks")
        if not worker.fallback_local:
            # the cluster's answer to "no prefill worker is left" is local prefill (waiting
            # requests, and the ones whose transfer failed, resubmitted here): without it a
            # request submitted then would end inside the worker with no event to send
            raise ValueError("a cluster's decode workers prefill locally what no prefill worker "
                             "serves: fallback_local must be True")
        self.rank, self.worker, self.links, self.control = rank, worker, links, control
        self.gen = gen
        self._cid: dict[int, int] = {}  # worker request id -> frontend request id
        self._tokens: dict[int, int] = {}  # frontend id -> tokens produced so far
        self._job: dict[int, tuple[list[int], int, int | None]] = {}  # to resubmit locally
        self._timed_out: set[int] = set()  # frontend ids resubmitted after a prefill timeout
        self._reporter = _Reporter(clock)
        self.taken = 0  # request messages received from the frontend
        self.resubmitted = 0  # requests prefilled here after their transfer failed
        self.busy_local = 0  # of which because every live prefill worker was full
        self.timeout_resubmitted = 0  # of which because their prefill worker timed out
        self.done = False
        # reported with the load: the process sets it once its links are up (cluster_run)
        self.ready = True

    def step(self) -> bool:
        """One round: control messages, one worker step, events and load out; False when
        there was nothing to do."""
        progress = False
        for header, _ in self.control.poll():
            progress = True
            kind = header.get("kind")
            if kind == "request":
                self.taken += 1
                self._submit(header)
            elif kind == "abort":
                self._abort(header.get("id"))
            elif kind == "prefill_ready" and isinstance(header.get("ranks"), list) and all(
                    is_int(r) for r in header["ranks"]):
                gens = header.get("gens")
                if isinstance(gens, list) and len(gens) == len(header["ranks"]) and all(
                        g is None or is_int(g) for g in gens):
                    self.links.set_ready(dict(zip(header["ranks"], gens, strict=True)))
                else:
                    self.links.set_ready(header["ranks"])
                self.links.set_avoided(_avoided_in(header))
            elif kind in ("shutdown", PEER_LOST):
                self.done = True  # (the frontend gone: nobody would read the results)
        if self.done:
            return False
        if self.worker.lost is not None and self.links.live():
            # a prefill worker (re)joined after every one was lost: ask it again
            self.worker.lost = None
        out = []
        for ev in self.worker.step():
            cid = self._cid.get(ev.request_id)
            if cid is None:
                continue
            if ev.kind == "error" and self._resubmit(ev.request_id, cid):
                continue
            if ev.kind == "token":
                self._tokens[cid] = self._tokens.get(cid, 0) + 1
            out.append([cid, ev.kind, ev.token, ev.error])
            if ev.kind in ("finished", "error"):
                self._end(ev.request_id, cid)
        if out:
            progress = True
            try_send(self.control, {"kind": "events", "events": out})
        self._report()
        return progress or self.worker._progress

    def load(self) -> Load:
        return load_of(self.worker.batcher, ready=self.ready)

    def _report(self) -> None:
        self._reporter.report(self.control, self.load(), {
            **_stats_of(self.worker.batcher), "retried": self.links.retried,
            "resubmitted": self.resubmitted, "busy_retried": self.links.busy_retried,
            "busy_local": self.busy_local, "local_fallbacks": self.worker.local_fallbacks,
            "prefill_timeouts": self.links.timeouts,
            "timeout_resubmitted": self.timeout_resubmitted,
            # prefill workers it takes for hung (asked nothing until they answer again)
            "unresponsive_prefill": len(self.links.unresponsive),
            "unresponsive_prefill_ranks": sorted(self.links.unresponsive),
            # requests moved off a worker another decode node reported (no deadline paid here)
            "unresponsive_moved": self.links.moved},
            took=self.taken, gen=self.gen, hung=self.links.hung_report())

    def _submit(self, h: dict[str, Any]) -> None:
        cid = h.get("id")
        if not isinstance(cid, int) or isinstance(cid, bool):
            return
        prompt, max_new, eos = h.get("prompt"), h.get("max_new_tokens"), h.get("eos")
        try:
            wid = self.worker.submit(prompt, max_new, eos)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            try_send(self.control, {"kind": "events", "events": [
                [cid, "error", None, f"decode worker {self.rank} refused the request: {exc}"]]})
            return
        ended = self.worker.requests[wid].error
        if ended is not None:
            # ended at once inside the worker (it emits no event for that): the frontend
            # must hear of it, or the request would stay open for good
            try_send(self.control, {"kind": "events", "events": [[cid, "error", None, ended]]})
            return
        self._cid[wid] = cid
        self._job[cid] = (list(prompt), max_new, eos)  # type: ignore[arg-type]
        p = h.get("prefill")
        self.links.route(f"{self.worker.wire_prefix}{wid}",
                         p if isinstance(p, int) and not isinstance(p, bool) else None)

    def _resubmit(self, wid: int, cid: int) -> bool:
        """A request whose transfer failed before it produced a token because every prefill
        worker was lost, or every live one refused it for backpressure (full): prefilled here
        instead (True), so it still ends once. One whose prefill worker let it time out is
        served too: that worker is taken for hung (`PrefillLinks.timed_out`) and the request
        is asked of another live one, once, else prefilled here."""
        req = self.worker.requests.get(wid)
        if req is None or self._tokens.get(cid):
            return False
        local = True
        if req.kind == "prefill_busy":
            self.busy_local += 1
        elif req.kind == "timeout":
            self.links.timed_out(req.wire)  # type: ignore[arg-type]
            # (a second timeout is not tried elsewhere again: local prefill always progresses)
            local = cid in self._timed_out or not self.links.live()
            self.timeout_resubmitted += 1
        elif req.kind != "peer_lost" or self.worker.lost is None:
            return False
        prompt, max_new, eos = self._job[cid]
        timed_out = req.kind == "timeout" or cid in self._timed_out  # (`_end` forgets it)
        self._end(wid, cid)
        new = self.worker.submit(prompt, max_new, eos, local=local)
        self._cid[new] = cid
        self._job[cid] = (prompt, max_new, eos)
        if timed_out:
            self._timed_out.add(cid)
        self.resubmitted += 1
        return True

    def _abort(self, cid: Any) -> None:
        for wid, c in list(self._cid.items()):
            if c == cid and self.worker.abort(wid):
                try_send(self.control, {"kind": "events", "events": [
                    [cid, "error", None, "aborted"]]})
                self._end(wid, cid)

    def _end(self, wid: int, cid: int) -> None:
        # (a request that ended before asking for its KV leaves no routing entry behind)
        self.links.route(f"{self.worker.wire_prefix}{wid}", None)
        self._cid.pop(wid, None)
        self._job.pop(cid, None)
        self._tokens.pop(cid, None)
        self._timed_out.discard(cid)

    def serve(self, idle_wait: float = 0.005) -> None:
        while not self.done:
            if not self.step():
                _wait(self, idle_wait)

    def close(self) -> None:
        self.worker.close()
        self.control.close()


class PrefillNode:
    """A prefill worker serving every decode worker's prefill requests."""

    def __init__(self, rank: int, worker: PrefillWorker, links: DecodeLinks,
                 control: Transport, clock: Callable[[], float] = time.monotonic,
                 gen: int | None = None) -> None:
        """`gen`: this process's generation, reported with its load: the frontend names it in
        its ready lists, so that decode workers ask this process, not an older one."""
        if worker.transport is not links:
            raise ValueError("the prefill worker must run over this node's DecodeLinks")
        self.rank, self.worker, self.links, self.control = rank, worker, links, control
        self.gen = gen
        self._reporter = _Reporter(clock)
        self.ready = True  # as DecodeNode.ready

    @property
    def done(self) -> bool:
        return self.worker.done

    def step(self) -> bool:
        progress = False
        for header, _ in self.control.poll():
            progress = True
            if header.get("kind") in ("shutdown", PEER_LOST) and not self.worker.done:
                self.worker.done = True
                self.worker.ended_by = "shutdown" if header["kind"] == "shutdown" else \
                    f"frontend lost: {header.get('error')}"
        if self.worker.done:
            return False
        progress = self.worker.step_once() or progress
        self._reporter.report(self.control, load_of(self.worker.batcher, ready=self.ready),
                              {**_stats_of(self.worker.batcher),
                               "refused_busy": self.worker.stats.refused_busy},
                              took=self.worker.stats.requests, gen=self.gen)
        return progress

    def serve(self, idle_wait: float = 0.005) -> None:
        while not self.done:
            if not self.step():
                _wait(self, idle_wait)

    def close(self) -> None:
        self.links.close()
        self.control.close()


def _avoided_in(header: dict[str, Any]) -> dict[int, int | None]:
    """The prefill workers a ready list names as not answering; none when it names none (a
    frontend that does not say) or says it malformed (the ready list alone still holds)."""
    try:
        return rank_gens(header.get("unresponsive", []))
    except ValueError:
        return {}


def _wait(node: DecodeNode | PrefillNode, timeout: float) -> None:
    """Until a message is on the node's control link or one of its links, or `timeout`."""
    poll_until(lambda: node.control.wait(0) or node.links.wait(0), timeout)


# --------------------------------------------------------------------------- frontend
@attrs.define
class ClusterResult:
    prompt: list[int]
    max_new_tokens: int
    decode: int | None
    prefill: int | None
    t_submit: float
    tokens: list[int] = attrs.Factory(list)
    error: str | None = None
    ended: bool = False
    t_first: float | None = None
    t_end: float | None = None
    # the router's report counts of its workers when it assigned them (`Router.release`)
    since: tuple[int, int] = (0, 0)


class Frontend:
    """The router's side: assigns requests (`Router`), collects their tokens, tracks the
    workers through their control links. `submit` and `step` are single-threaded."""

    def __init__(self, router: Router, clock: Callable[[], float] = time.perf_counter, *,
                 keep_ended: int = 10_000, max_request_bytes: int = CONTROL_BYTES,
                 max_open: int = 100_000, vocab_size: int | None = None) -> None:
        """`keep_ended`: how many ended requests `results` still holds (older ones are
        forgotten, so a long-running frontend's memory does not grow with what it served).
        `max_request_bytes`: the largest request message (JSON) a decode worker's control
        link takes (`cluster_run.link_limits`: at least CONTROL_BYTES); a larger request is
        refused at submit. `max_open`: the most requests open at once; more are refused at
        submit (each open one holds its prompt and tokens here and a place in a decode worker's
        queue: without a bound, clients submitting faster than the cluster serves would grow
        both until memory runs out). `vocab_size`: the workers' vocabulary, which every token a
        decode worker reports must be in (None: not known, any id below 2**31)."""
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        self.router, self.clock = router, clock
        self.max_open = max_open
        self.keep_ended = keep_ended
        self.max_request_bytes = max_request_bytes
        self.vocab_size = vocab_size
        self.controls: dict[tuple[str, int], Transport] = {}
        # (role, rank) -> why: the workers taken for faulty (a malformed report, `_faulty`)
        self.faulty: dict[tuple[str, int], str] = {}
        self.results: dict[int, ClusterResult] = {}
        self.worker_stats: dict[tuple[str, int], dict[str, Any]] = {}
        # the router's time per request, the latest ones
        self.route_seconds: deque[float] = deque(maxlen=100_000)
        self._ended: deque[int] = deque()
        self.late_events = 0  # for requests already ended: dropped (each ends once)
        self._next = 0
        self._open: set[int] = set()
        # decode rank -> the prefill ranks (and their generations) it was told are ready, and
        # the ones it was told are not answering
        self._told_ready: dict[int, tuple[list[int], list[int | None], list[list[int | None]]]] \
            = {}
        # decode rank -> the prefill workers (rank -> generation) it reports as not answering
        self.unresponsive: dict[int, dict[int, int | None]] = {}
        # (role, rank) -> the generation its current control link's worker reported
        self.gens: dict[tuple[str, int], int | None] = {}
        self.closed = False  # shut down: nothing more is submitted or served

    def add(self, role: str, rank: int, control: Transport) -> None:
        """A worker's control link (a new worker, or a restarted one): it is chosen once it
        reports ready."""
        old = self.controls.get((role, rank))
        if old is not None and old is not control:
            old.close()
            self._lost(role, rank, "restarted")
        self.controls[(role, rank)] = control
        self.gens.pop((role, rank), None)  # a new process: known once it reports
        if self.closed:
            try_send(control, {"kind": "shutdown"})  # (linked after the shutdown: stop it too)
        if role == "decode":
            self._told_ready.pop(rank, None)  # a new worker: tell it
        self._tell_ready()

    def _tell_ready(self) -> None:
        """Tell each decode worker which prefill workers are ready, when that changed: the
        ones the router may choose, and apart the ready ones a decode worker reports as not
        answering (a node that does not know that field still leaves them out)."""
        avoided = self._avoid_unresponsive()
        ranks = self.router.usable("prefill")
        aside = [[r, avoided[r]] for r in self.router.ready("prefill") if r in avoided]
        ready = (ranks, [self.gens.get(("prefill", r)) for r in ranks], aside)
        for (role, rank), link in self.controls.items():
            if role == "decode" and self._told_ready.get(rank) != ready and \
                    try_send(link, {"kind": "prefill_ready", "ranks": ready[0],
                                 "gens": ready[1], "unresponsive": ready[2]}):
                self._told_ready[rank] = ready

    def _avoid_unresponsive(self) -> dict[int, int | None]:
        """The prefill workers some decode worker reports as not answering, each with its
        current generation (as far as known), set aside in the router. A report about another
        generation than the one that last reported to the frontend is about a process that is
        gone (the decode worker has not seen the restart yet): it sets nothing aside."""
        out: dict[int, int | None] = {}
        for reported in self.unresponsive.values():
            for p, gen in reported.items():
                now = self.gens.get(("prefill", p))
                if gen is None or now is None or gen == now:
                    out[p] = now if now is not None else gen
        self.router.avoid("prefill", frozenset(out))
        return out

    def submit(self, prompt: Iterable[int], max_new_tokens: int, eos: int | None = None) -> int:
        prompt = list(prompt)
        cid = self._next
        self._next += 1
        t0 = self.clock()
        try:
            if self.closed:
                # its workers were told to stop: the request would wait for them forever
                raise RuntimeError("the cluster was shut down: no request is served any more")
            if len(self._open) >= self.max_open:
                raise RuntimeError(f"{len(self._open)} requests are open (max_open): retry "
                                   "once some have ended")
            if not all(is_int(x) and 0 <= x < 2 ** 31
                       for x in prompt):
                raise ValueError("the prompt must be a list of token ids (integers >= 0)")
            self._check_size(prompt, max_new_tokens, eos)
            t = time.perf_counter()
            a = self.router.assign(prompt)
        except (RuntimeError, ValueError) as exc:
            self.results[cid] = ClusterResult(prompt, max_new_tokens, None, None, t0,
                                              error=str(exc))
            self._end(cid, t0)
            return cid
        self.route_seconds.append(time.perf_counter() - t)
        reports = self.router.reports
        self.results[cid] = ClusterResult(
            prompt, max_new_tokens, a.decode, a.prefill, t0,
            since=(reports["decode"].get(a.decode, 0),
                   reports["prefill"].get(a.prefill, 0) if a.prefill is not None else 0))
        self._open.add(cid)
        if not try_send(self.controls[("decode", a.decode)],
                     {"kind": "request", "id": cid, "prompt": prompt,
                      "max_new_tokens": max_new_tokens, "eos": eos, "prefill": a.prefill}):
            self._lost("decode", a.decode, "its control link is down")
        return cid

    def _check_size(self, prompt: list[int], max_new_tokens: Any, eos: Any) -> None:
        """ValueError unless the request's message can reach its decode worker: a message
        that is not JSON would raise in the send (after the request was counted open: it would
        never end), and one above the link's frame limit ends the decode worker's control link
        (its receiver refuses the frame, `GlooTransport`), failing every request it holds."""
        msg = {"kind": "request", "id": 2 ** 63, "prompt": prompt,
               "max_new_tokens": max_new_tokens, "eos": eos, "prefill": 2 ** 31}
        try:
            size = len(json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode())
        except (TypeError, ValueError) as exc:
            raise ValueError(f"max_new_tokens and eos must be integers (JSON): {exc}"[:300]
                             ) from None
        if size > self.max_request_bytes:
            raise ValueError(f"the request is too large for the cluster's control links "
                             f"({size} bytes, the limit is {self.max_request_bytes}): a prompt "
                             f"of {len(prompt)} tokens is far longer than any worker takes")

    def busy(self) -> bool:
        return bool(self._open)

    def abort(self, cid: int) -> bool:
        """Ask the request's decode worker to end it (it ends with error "aborted", or as it
        was already ending); False for unknown or ended requests."""
        r = self.results.get(cid)
        if r is None or r.ended or r.decode is None:
            return False
        return try_send(self.controls[("decode", r.decode)], {"kind": "abort", "id": cid})

    def step(self) -> bool:
        progress = False
        for (role, rank), link in list(self.controls.items()):
            for header, _ in link.poll():
                progress = True
                try:
                    self._on_message(role, rank, header)
                except ReportError as exc:
                    self._faulty(role, rank, link, str(exc))
                    break  # (its link is closed: nothing more of it is read)
        self._tell_ready()
        return progress

    def _on_message(self, role: str, rank: int, h: Any) -> None:
        """Take one control message of worker (role, rank); ReportError, and nothing is taken,
        if it is not a report (`parse_report`)."""
        report = parse_report(role, h, vocab_size=self.vocab_size, issued=self._next)
        if isinstance(report, LostReport):
            self._lost(role, rank, report.why)
        elif isinstance(report, LoadReport):
            self.gens[(role, rank)] = report.gen
            self.router.report(role, rank, report.load)
            if report.hung is not None and rank not in self.router.lost[role]:
                self.unresponsive[rank] = report.hung  # (a lost worker's late report: nothing)
            self.worker_stats[(role, rank)] = report.stats
        else:
            now = self.clock()
            for row in report.events:
                r = self.results.get(row.cid)
                if r is None or r.ended or r.decode != rank:
                    self.late_events += 1
                    continue
                if row.kind == "token":
                    r.tokens.append(row.token)  # type: ignore[arg-type]
                    if r.t_first is None:
                        r.t_first = now
                elif row.kind in ("finished", "error"):
                    r.error = row.error
                    self._end(row.cid, now)

    def _faulty(self, role: str, rank: int, link: Transport, why: str) -> None:
        """Worker (role, rank) sent a control message that is not a report (a bug, or a
        compromised worker holding the key): nothing it says can be trusted any more. It is
        lost as a dead worker is (a decode worker's open requests fail; a prefill worker's are
        asked again elsewhere by their decode workers once it stops), told to stop, and its
        control link closed, so nothing more of it is read; a new process of that rank comes
        back through `add`. The frontend goes on serving the others."""
        log.warning("frontend: %s worker %d sent a malformed report, taken for faulty and "
                    "stopped: %s", role, rank, why)
        self.faulty[(role, rank)] = why
        if self.controls.get((role, rank)) is link:
            del self.controls[(role, rank)]
        self.gens.pop((role, rank), None)
        if role == "decode":
            self._told_ready.pop(rank, None)
        try_send(link, {"kind": "shutdown"})
        link.close()
        self._lost(role, rank, f"taken for faulty: {why}")

    def _lost(self, role: str, rank: int, why: str) -> None:
        self.router.mark_lost(role, rank)
        if role != "decode":
            return  # its decode workers re-ask another prefill worker, or prefill locally
        # what it reported set workers aside for everyone: gone with it (else they would stay
        # aside for good, nobody else withdrawing its report)
        self.unresponsive.pop(rank, None)
        now = self.clock()
        for cid in sorted(self._open):
            r = self.results[cid]
            if r.decode == rank:
                r.error = (f"decode worker {rank} was lost ({why[:160]}): this request ended "
                           "with it; submit it again (the other workers are unaffected)")
                self._end(cid, now)

    def _end(self, cid: int, now: float) -> None:
        r = self.results[cid]
        if r.decode is not None:
            self.router.release("decode", r.decode, r.since[0])
        if r.prefill is not None:
            self.router.release("prefill", r.prefill, r.since[1])
        self.results[cid].ended, self.results[cid].t_end = True, now
        self._open.discard(cid)
        self._ended.append(cid)
        while len(self._ended) > self.keep_ended:
            del self.results[self._ended.popleft()]

    def shutdown(self) -> None:
        """Tell every worker to stop, and end every open request with an error (its tokens so
        far stay in its result): the stopped workers send no more events, so an open request
        would otherwise never end, and a caller waiting for it (`busy`) would wait forever."""
        self.closed = True
        for link in self.controls.values():
            try_send(link, {"kind": "shutdown"})
        now = self.clock()
        for cid in sorted(self._open):
            r = self.results[cid]
            r.error = (f"the cluster shut down before this request ended ({len(r.tokens)} "
                       "tokens generated); submit it again to a running cluster")
            self._end(cid, now)

    def close(self) -> None:
        self.shutdown()
        for link in self.controls.values():
            link.close()

    def summary(self) -> dict[str, Any]:
        rs = list(self.results.values())
        ended = [r for r in rs if r.t_end is not None]
        wall = max((r.t_end for r in ended), default=0.0) - min(  # type: ignore[type-var]
            (r.t_submit for r in rs), default=0.0)
        tokens = sum(len(r.tokens) for r in rs)
        ttft = sorted(r.t_first - r.t_submit for r in rs if r.t_first is not None)
        route = sorted(self.route_seconds)
        return {"requests": len(rs), "failed": sum(r.error is not None for r in rs),
                "generated_tokens": tokens, "wall_s": round(wall, 3),
                "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
                "ttft_median_s": quantile(ttft, 0.5),
                "route_median_us": None if not route else round(
                    route[(len(route) - 1) // 2] * 1e6, 1),
                "affinity_hits": dict(self.router.affinity_hits),
                "late_events": self.late_events}


# --------------------------------------------------------------------------- in-process
def _pair(key: bytes | None) -> tuple[Transport, Transport]:
    """Two joined ends (the initiator's first); with a key each a SecureLink, handshake done."""
    a, b = InProcessTransport.pair()
    if key is None:
        return a, b
    from atom_core.pd.secure_link import SecureLink, establish_pair

    la = SecureLink(a, key, "decode", max_box_bytes=None)
    lb = SecureLink(b, key, "prefill", max_box_bytes=None)
    establish_pair(la, lb)
    return la, lb


class LocalCluster:
    """`prefill` prefill workers and `decode` decode workers and a frontend, stepped in turn
    in one thread over in-process links (tests, benchmarks). `kill`/`start` take a worker down
    or bring one (back) up; `runtime_for(cfg)` makes each worker's model (all the same)."""

    def __init__(self, cfg: Config, runtime_for: Callable[[Config], Any], *, prefill: int,
                 decode: int, key: bytes | None = None, insecure: bool = False,
                 policy: Policy | None = None, prefetch: int = 0,
                 pcfg: Config | None = None, prefill_options: Mapping[str, Any] | None = None,
                 decode_options: Mapping[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`prefill_options` / `decode_options`: more keyword arguments of every
        `PrefillWorker` (e.g. max_queued, ghost) / `DecodeWorker` (e.g. clock,
        transfer_timeout); `clock`: what paces the nodes' reports of counters alone (a
        simulation passes its own, so that runs replay exactly)."""
        if key is None and not insecure:
            from atom_core.pd.workers import NO_KEY

            raise ValueError(NO_KEY)
        self.cfg, self.pcfg = cfg, pcfg or cfg
        self.runtime_for, self.key, self.prefetch = runtime_for, key, prefetch
        self.prefill_options = dict(prefill_options or {})
        self.decode_options = dict(decode_options or {})
        self.clock = clock
        self.frontend = Frontend(Router(prefix_unit(self.pcfg), policy))
        self.prefills: dict[int, PrefillNode] = {}
        self.decodes: dict[int, DecodeNode] = {}
        self._gen = 0
        for p in range(prefill):
            self.start("prefill", p)
        for d in range(decode):
            self.start("decode", d)
        self.step()  # the first load reports: every worker ready

    def start(self, role: str, rank: int, ready: bool = True) -> None:
        """Start worker `rank` of `role` (again, after `kill`), linked to every live worker of
        the other role and to the frontend. `ready` False: it reports not ready (as a process
        still linking to its peers) until its node's `ready` is set."""
        self._gen += 1
        key, insecure = self.key, self.key is None
        fe_end, control = _pair(key)
        rt = self.runtime_for(self.pcfg if role == "prefill" else self.cfg)
        if self.frontend.vocab_size is None:  # (every worker runs the same model)
            self.frontend.vocab_size = getattr(rt, "vocab_size", None)
        if role == "prefill":
            links = DecodeLinks(secure=key is not None)
            worker = PrefillWorker(self.pcfg, rt, links, key=key, insecure=insecure,
                                   **self.prefill_options)
            for d, dn in self.decodes.items():
                if not dn.done:
                    de, pe = _pair(key)
                    dn.links.add(rank, de, gen=self._gen)
                    links.add(d, pe, gen=dn.gen)
            self.prefills[rank] = PrefillNode(rank, worker, links, control, self.clock,
                                              gen=self._gen)
            self.prefills[rank].ready = ready
        else:
            links_p = PrefillLinks(secure=key is not None)
            dworker = DecodeWorker(self.cfg, rt, links_p, key=key, insecure=insecure,
                                   prefetch=self.prefetch,
                                   wire_prefix=f"d{rank}g{self._gen}.", **self.decode_options)
            for p, pn in self.prefills.items():
                if not pn.done:
                    de, pe = _pair(key)
                    pn.links.add(rank, pe, gen=self._gen)
                    links_p.add(p, de, gen=pn.gen)
            self.decodes[rank] = DecodeNode(rank, dworker, links_p, control, self.clock,
                                            gen=self._gen)
            self.decodes[rank].ready = ready
        self.frontend.add(role, rank, fe_end)

    def kill(self, role: str, rank: int) -> None:
        """The worker's process dies: every link it has ends at once, as a killed process's
        sockets do."""
        node: Any = self.prefills[rank] if role == "prefill" else self.decodes[rank]
        for link in [*node.links.links.values(), node.control]:
            inner = getattr(link, "inner", link)
            inner.kill()
        if role == "prefill":
            node.worker.done = True
        else:
            node.done = True

    def submit(self, prompt: Iterable[int], max_new_tokens: int, eos: int | None = None) -> int:
        return self.frontend.submit(prompt, max_new_tokens, eos)

    def step(self) -> None:
        for node in [*self.decodes.values(), *self.prefills.values()]:
            if not node.done:
                node.step()
                if node.done:
                    # it stopped (told to, or its frontend link lost): its links end, as a
                    # worker process's do when it exits (cluster_run.run_worker), and its
                    # peers move what they had with it
                    node.close()
        self.frontend.step()

    def run_until_done(self, rounds: int = 20_000,
                       each: Callable[[int], None] | None = None) -> dict[int, ClusterResult]:
        """Step until every request ended; `each(round)` runs before each round (faults)."""
        for i in range(rounds):
            if not self.frontend.busy():
                return self.frontend.results
            if each is not None:
                each(i)
            self.step()
        raise AssertionError(f"requests still running after {rounds} rounds: "
                             f"{sorted(self.frontend._open)}")

    def settle(self, rounds: int = 2000) -> None:
        """Step until no worker holds any request (after the frontend saw every end)."""
        for _ in range(rounds):
            if not any(n.worker.batcher.busy() for n in self.live()):
                return
            self.step()
        raise AssertionError("workers still busy")

    def live(self) -> list[Any]:
        return [n for n in [*self.prefills.values(), *self.decodes.values()] if not n.done]

    def close(self) -> None:
        """Shut the cluster down: every open request ends with an error (`Frontend.shutdown`),
        every worker is told to stop, sees it (one step) and closes its links."""
        self.frontend.shutdown()
        for node in self.live():
            node.step()  # takes the shutdown: done
        for node in [*self.prefills.values(), *self.decodes.values()]:
            node.close()  # (killed ones too: closing a closed link does nothing)
        self.frontend.close()
