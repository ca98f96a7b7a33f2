"""A cluster run (`Clustered`): the router's choices and bookkeeping against the workers'
truth, and why a request may fail.

- When a request is assigned (`assignment_problems`): its decode worker and its prefill
  worker (if any) are running and ready; the router remembers prefixes only for workers it
  has a load for, and only prefixes it sent to that worker since the worker (re)started; an
  affinity hit names a worker that was sent a prefix of this prompt since it started.
- After every tick (`router_problems`; the frontend has just read every worker's report):
  the router's ready workers of each role are exactly the running, ready ones; no lost worker
  has a load; each load's ready flag, free lanes and free blocks are the worker's own; a
  decode worker's queue is exactly its own, a prefill worker's its own plus the requests
  assigned to it that it has not reported since; no event arrived for an ended request (each
  ends once); every open request's decode worker is running; no prefill worker that has not
  reported ready was asked for a prefill (by a decode worker's links, retries included).
- When a request ends with an error (`ending_problems`): only an abort the client sent, a
  decode worker that was killed or restarted after the request was assigned to it ("decode
  worker N was lost"), or no decode worker ready at submission explain it. A refusal for
  backpressure or a lost prefill worker never does: those are retried or prefilled locally.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from atom_core.pd.router import ROLES

if TYPE_CHECKING:
    from atom_core.simulate.driver import Sim
    from atom_core.simulate.servers import Clustered


def assignment_problems(server: Clustered, cid: int, hits_before: int) -> list[str]:
    r = server.fe.results[cid]
    out = []
    if r.decode is None:
        if server.running("decode") and any(server.c.decodes[d].ready
                                            for d in server.running("decode")):
            out.append(f"request {cid} was refused ({r.error}) while a decode worker was ready")
        return out
    for role, w in (("decode", r.decode), ("prefill", r.prefill)):
        if w is None:
            continue
        node = server.nodes(role).get(w)
        if node is None or node.done:
            out.append(f"the router sent request {cid} to {role} worker {w}, which is dead")
        elif not node.ready:
            out.append(f"the router sent request {cid} to {role} worker {w}, which has not "
                       "reported ready")
    if r.prefill is None and any(server.c.prefills[p].ready
                                 for p in server.running("prefill")):
        out.append(f"request {cid} got no prefill worker while one was ready")
    router = server.router
    for w, seen in router._seen["prefill"].items():
        if w not in router.loads["prefill"]:
            out.append(f"the router remembers prefixes of prefill worker {w}, which it has "
                       "no load for (lost)")
        elif not set(seen) <= server.sent.get(w, set()) | set(router.prefix_keys(r.prompt)):
            out.append(f"the router remembers prefixes for prefill worker {w} that were not "
                       "sent to it since it started")
    if router.affinity_hits["prefill"] > hits_before:
        keys = router.prefix_keys(r.prompt)
        if r.prefill is None or not keys or keys[0] not in server.sent.get(r.prefill, set()):
            out.append(f"request {cid} counted an affinity hit on prefill worker {r.prefill}, "
                       "which was sent no prefix of its prompt since it started")
    return out


def router_problems(server: Clustered) -> list[str]:
    out = list(server.problems)
    server.problems.clear()
    router = server.router
    for role in ROLES:
        truth = sorted(w for w in server.running(role) if server.nodes(role)[w].ready)
        if router.ready(role) != truth:
            out.append(f"the router has {role} workers {router.ready(role)} ready, the running "
                       f"ready ones are {truth}")
        for w in sorted(router.lost[role] & set(router.loads[role])):
            out.append(f"{role} worker {w} is lost but the router has a load for it")
        for w, ld in sorted(router.loads[role].items()):
            node = server.nodes(role).get(w)
            if node is None or node.done:
                if ld.ready:
                    out.append(f"{role} worker {w} is dead but the router has it ready")
                continue
            own = node.load() if role == "decode" else _prefill_load(node)
            if (ld.ready, ld.free_lanes, ld.free_blocks) != \
                    (own.ready, own.free_lanes, own.free_blocks):
                out.append(f"the router has {role} worker {w}'s load as {ld}, the worker's "
                           f"is {own}")
            pending = 0 if role == "decode" else sum(
                1 for cid in server.open if server.fe.results[cid].prefill == w
                and server.fe.results[cid].since[1] == router.reports[role].get(w, 0))
            if not own.queued <= ld.queued <= own.queued + pending:
                out.append(f"the router counts {ld.queued} requests queued at {role} worker "
                           f"{w}: it holds {own.queued}, and {pending} assigned to it are "
                           "not reported yet")
    if server.fe.late_events > server.late_seen:
        out.append(f"{server.fe.late_events - server.late_seen} events arrived for requests "
                   "already ended")
        server.late_seen = server.fe.late_events
    running = set(server.running("decode"))
    for cid in sorted(server.open):
        d = server.fe.results[cid].decode
        if d not in running:
            out.append(f"request {cid} is still open on decode worker {d}, which is dead")
    return out


def _prefill_load(node: object) -> object:
    from atom_core.pd.router import load_of

    return load_of(node.worker.batcher, ready=node.ready)  # type: ignore[attr-defined]


def ending_problems(sim: Sim, i: int, kind: str) -> Iterator[tuple[str, str]]:
    server: Clustered = sim.server  # type: ignore[assignment]
    if kind == "finished":
        return
    cid = sim.ids[i]
    r = server.fe.results[cid]
    error = r.error or ""
    if error == "aborted" and cid in server.aborted:
        return
    if r.decode is None and "no decode worker is ready" in error:
        return
    if f"decode worker {r.decode} was lost" in error and \
            server.down.get(("decode", r.decode), 0) > server.down_at_submit.get(cid, 0):
        return
    yield "lifecycle", (f"request {i} failed ({error[:200]!r}) although its decode worker "
                        f"{r.decode} was neither killed nor restarted and it was not aborted")
