"""The cluster's frontend: the router's side, which assigns requests to workers (`Router`),
collects their tokens from the decode workers' events, and tracks every worker through its
control link (reports, losses, restarts, the faulty).

Apart from the nodes (atom_core/pd/cluster.py) because it runs in a process of its own, not a
worker's (`atom-core pd-cluster`, cluster_run.py); `LocalCluster` steps both in one thread.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from atom_core.pd.cluster_reports import (
    CONTROL_BYTES,
    LoadReport,
    LostReport,
    ReportError,
    parse_report,
)
from atom_core.pd.links import try_send
from atom_core.pd.payload import is_int
from atom_core.pd.router import Router
from atom_core.pd.transport import Transport
from atom_core.pd.workers import quantile

# (the name the frontend's warnings were always logged under: log settings select it)
log = logging.getLogger("atom_core.pd.cluster")


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
