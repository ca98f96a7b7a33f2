"""A PD cluster: N prefill workers, M decode workers and a router (`Frontend`, in
atom_core/pd/cluster_frontend.py).

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
(`parse_report`, atom_core/pd/cluster_reports.py, checks every field of every kind before
anything is taken: a token that is no id of the vocabulary, an unknown kind, a missing
field...) is taken for faulty: one log line says which and why, it is lost as above, told to
stop and its control link closed (`Frontend.faulty`); the frontend goes on serving the others.

`LocalCluster` runs all of it in one thread over `InProcessTransport` pairs (tests, bench);
`atom-core pd-cluster` (atom_core/pd/cluster_run.py) runs one process per worker over gloo.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from atom_core.config import Config
from atom_core.pd.cluster_frontend import ClusterResult, Frontend
from atom_core.pd.cluster_reports import (
    CONTROL_BYTES,
    EVENT_KINDS,
    MAX_EVENTS,
    MAX_STAT_NAME,
    MAX_STATS,
    MAX_UNRESPONSIVE,
    TOKEN_LIMIT,
    EventRow,
    EventsReport,
    LoadReport,
    LostReport,
    ReportError,
    parse_report,
    rank_gens,
)
from atom_core.pd.links import DecodeLinks, PrefillLinks, poll_until, try_send
from atom_core.pd.payload import is_int
from atom_core.pd.router import Load, Policy, Router, load_of
from atom_core.pd.transport import PEER_LOST, InProcessTransport, Transport
from atom_core.pd.workers import DecodeWorker, PrefillWorker

# (the reports and the frontend are cluster_reports.py's and cluster_frontend.py's; their names
# are re-exported here, where callers have always imported them)
__all__ = ["CONTROL_BYTES", "EVENT_KINDS", "MAX_EVENTS", "MAX_STATS", "MAX_STAT_NAME",
           "MAX_UNRESPONSIVE", "STATS_EVERY", "TOKEN_LIMIT", "ClusterResult", "DecodeNode",
           "EventRow", "EventsReport", "Frontend", "LoadReport", "LocalCluster", "LostReport",
           "PrefillNode", "ReportError", "parse_report", "prefix_unit", "rank_gens"]


def prefix_unit(cfg: Config) -> int:
    """The granularity at which `cfg`'s prefix cache hits: one chunk with one block per table,
    else one block."""
    return cfg.prefill_chunk if cfg.blocks_per_table == 1 else cfg.block_size


def _stats_of(batcher: Any) -> dict[str, int]:
    st = batcher.stats
    return {"prefill_tokens": st.prefill_tokens, "prefix_hit_tokens": st.prefix_hit_tokens,
            "imported_tokens": st.imported_tokens, "generated_tokens": st.generated_tokens,
            "exports": st.exports}


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
        node: PrefillNode | DecodeNode = \
            self.prefills[rank] if role == "prefill" else self.decodes[rank]
        if self.frontend.vocab_size is None:  # (every worker runs the same model, read once)
            self.frontend.vocab_size = node.worker.batcher.capabilities.vocab_size
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
