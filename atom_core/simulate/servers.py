"""The servers a run drives: one colocated batcher, a PD prefill worker feeding a decode
worker over an in-process link, or a cluster of prefill and decode workers behind the router
(`LocalCluster`) whose workers die, restart and join late (`Server`)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from atom_core.batcher import AtomBatcher
from atom_core.config import Config
from atom_core.pd import secure_link, workers
from atom_core.pd.cluster import LocalCluster
from atom_core.pd.transport import InProcessTransport
from atom_core.simulate.faulty_link import SimLink
from atom_core.simulate.workload import Item

if TYPE_CHECKING:
    from atom_core.simulate.driver import Sim
    from atom_core.simulate.faulty_runtime import FaultyRuntime

# Simulated seconds (ticks) before the decode worker gives up on a transfer: long enough that
# a busy prefill worker answers in time, short enough that a drain after a lost message ends.
TRANSFER_TIMEOUT = 120.0

# The simulation's PD key (its links are authenticated and encrypted, as in production).
SIM_KEY = b"atom-core simulation pd key 0001"


class SimClock:
    """Simulated seconds, one per tick: the decode worker's clock (`DecodeWorker(clock=...)`),
    which drives its transfer timeout, so that replays time out at the same tick."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Colocated:
    """One batcher serving requests end to end."""

    def __init__(self, sim: Sim) -> None:
        conf = sim.configs["local"]
        self.runtimes = {"local": sim.runtime("local", conf)}
        self.b = AtomBatcher(conf, self.runtimes["local"], ghost=True,
                             trace=sim.trace_sink("local"))
        self.links: dict[str, SimLink] = {}

    def batchers(self) -> dict[str, AtomBatcher]:
        return {"local": self.b}

    def submit(self, it: Item) -> int:
        return self.b.submit(it.prompt, it.max_new_tokens, it.eos)

    def abort(self, rid: int) -> bool:
        return self.b.abort(rid)

    def tick(self) -> list[tuple[int, str]]:
        return [(e.request_id, e.kind) for e in self.b.step() if e.kind in ("finished", "error")]

    def result(self, rid: int) -> tuple[list[int], str | None]:
        r = self.b.requests[rid]
        return list(r.tokens), r.error

    def idle(self) -> bool:
        return not self.b.busy()

    def at_rest(self) -> dict[str, AtomBatcher]:
        return self.batchers()

    def decode_workers(self) -> dict[str, workers.DecodeWorker]:
        return {}

    def counters(self) -> dict[str, int]:
        return {}

    @property
    def alive(self) -> bool:
        return False  # no link to fault


class Disaggregated:
    """A PD prefill worker feeding a decode worker, stepped alternately, one tick each."""

    def __init__(self, sim: Sim) -> None:
        cfg = sim.cfg
        td, tp = InProcessTransport.pair()
        self.links = {"decode": SimLink(td, sim.count), "prefill": SimLink(tp, sim.count)}
        self.runtimes = {side: sim.runtime(side, sim.configs[side])
                         for side in ("decode", "prefill")}
        dconf, pconf = sim.configs["decode"], sim.configs["prefill"]
        # ghost batchers: the checks cover the ghost invariants too
        # the workers' links are SecureLinks over the SimLinks (faults act on the sealed boxes),
        # their handshake done here, before any fault can be armed
        dlink = secure_link.SecureLink(self.links["decode"], SIM_KEY, "decode", clock=sim.clock)
        plink = secure_link.SecureLink(self.links["prefill"], SIM_KEY, "prefill", clock=sim.clock)
        secure_link.establish_pair(dlink, plink)
        self.pw = workers.PrefillWorker(pconf, self.runtimes["prefill"], plink, key=SIM_KEY,
                                        ghost=True, trace=sim.trace_sink("prefill"))
        self.dw = workers.DecodeWorker(dconf, self.runtimes["decode"], dlink, key=SIM_KEY,
                                       fallback_local=bool(cfg.fallback_local),
                                       transfer_timeout=TRANSFER_TIMEOUT,
                                       prefetch=cfg.prefetch or 0, ghost=True, clock=sim.clock,
                                       trace=sim.trace_sink("decode"))

    def batchers(self) -> dict[str, AtomBatcher]:
        return {"decode": self.dw.batcher, "prefill": self.pw.batcher}

    def submit(self, it: Item) -> int:
        return self.dw.submit(it.prompt, it.max_new_tokens, it.eos)

    def abort(self, wid: int) -> bool:
        return self.dw.abort(wid)

    def tick(self) -> list[tuple[int, str]]:
        out = [(e.request_id, e.kind) for e in self.dw.step() if e.kind in ("finished", "error")]
        if not self.pw.done:
            self.pw.step_once()
        return out

    def result(self, wid: int) -> tuple[list[int], str | None]:
        r = self.dw.results()[wid]
        return list(r.tokens), r.error

    def idle(self) -> bool:
        return not self.dw.busy() and (self.pw.done or not self.pw.batcher.busy())

    def at_rest(self) -> dict[str, AtomBatcher]:
        # a prefill worker that was lost keeps what it held: it will never step again
        return self.batchers() if not self.pw.done else {"decode": self.dw.batcher}

    def decode_workers(self) -> dict[str, workers.DecodeWorker]:
        return {"decode": self.dw}

    def counters(self) -> dict[str, int]:
        return {}

    @property
    def alive(self) -> bool:
        return self.links["prefill"].alive


class Clustered:
    """`LocalCluster`: `prefill_workers` prefill and `decode_workers` decode workers (ranks),
    the frontend and its router, stepped in one thread, one round per tick. Some ranks start
    late (drawn from the seed); `kill`, `start` (a late join, or a restart of a killed rank,
    possibly not ready at first) and `make_ready` are the fault events' hooks. Each start
    makes the worker anew (a fresh runtime: a new process's caches are empty). Request ids
    are the frontend's; what the checks need (who was killed, what was assigned where, which
    prefixes each prefill worker was sent since it started) is recorded here."""

    def __init__(self, sim: Sim) -> None:
        cfg = sim.cfg
        assert cfg.prefill_workers and cfg.decode_workers
        self.sim = sim
        self.runtimes: dict[str, FaultyRuntime] = {}
        self.links: dict[str, SimLink] = {}  # no link faults: the cluster's faults are workers
        self.n = {"prefill": cfg.prefill_workers, "decode": cfg.decode_workers}
        self._making = ""
        self.c = LocalCluster(
            sim.configs["decode"], self._runtime_for, prefill=0, decode=0, key=SIM_KEY,
            pcfg=sim.configs["prefill"], prefetch=cfg.prefetch or 0,
            prefill_options={"ghost": True, "max_queued": cfg.prefill_max_queued},
            decode_options={"ghost": True, "clock": sim.clock, "fallback_local": True,
                            "transfer_timeout": TRANSFER_TIMEOUT},
            clock=sim.clock)
        self.fe = self.c.frontend
        self.router = self.fe.router
        self.starts: dict[tuple[str, int], int] = {}  # (role, rank) -> how many starts
        self.down: dict[tuple[str, int], int] = {}  # decode rank -> kills or restarts
        self.sent: dict[int, set[bytes]] = {}  # prefill rank -> prefix keys since its start
        self.open: set[int] = set()
        self.down_at_submit: dict[int, int] = {}  # request -> its decode rank's `down` then
        self.aborted: set[int] = set()  # requests an abort was sent for
        self.problems: list[str] = []  # found at submit (`checks.cluster`)
        self.every: list[Any] = []  # every node started, killed ones too (their counters)
        self.late_seen = 0  # the frontend's late_events already reported
        self.counts = {"kills": 0, "starts": 0, "late_joins": 0, "restarts": 0}
        # which ranks start at once: every one, or all but the last (it joins late); one
        # decode worker at least
        rng = random.Random(f"atom-core-simulate-cluster-{cfg.seed}")
        for role in ("decode", "prefill"):
            n = self.n[role]
            first = n - 1 if rng.random() < 0.4 and (n > 1 or role == "prefill") else n
            for rank in range(first):
                self.start(role, rank, ready=True, count=False)
        self.c.step()

    def _runtime_for(self, conf: Config) -> Any:
        rt = self.sim.runtime(self._making.rstrip("0123456789"), conf)
        self.runtimes[self._making] = rt
        return rt

    # ------------------------------------------------------------------ workers
    def nodes(self, role: str) -> dict[int, Any]:
        return self.c.prefills if role == "prefill" else self.c.decodes

    def running(self, role: str) -> list[int]:
        return sorted(r for r, n in self.nodes(role).items() if not n.done)

    def stopped(self, role: str) -> list[int]:
        return [r for r in range(self.n[role]) if r not in self.running(role)]

    def start(self, role: str, rank: int, ready: bool, count: bool = True) -> bool:
        if rank in self.running(role) or not 0 <= rank < self.n[role]:
            return False
        key = (role, rank)
        if count:
            self.counts["restarts" if key in self.starts else "late_joins"] += 1
            self.counts["starts"] += 1
        if key in self.starts and role == "decode":
            self.down[key] = self.down.get(key, 0) + 1
        self.starts[key] = self.starts.get(key, 0) + 1
        self._making = f"{role}{rank}"
        self.c.start(role, rank, ready=ready)
        self.every.append(self.nodes(role)[rank])
        if role == "prefill":
            self.sent[rank] = set()
        return True

    def kill(self, role: str, rank: int) -> bool:
        if rank not in self.running(role):
            return False
        self.c.kill(role, rank)
        self.counts["kills"] += 1
        if role == "decode":
            self.down[(role, rank)] = self.down.get((role, rank), 0) + 1
        return True

    def make_ready(self, role: str, rank: int) -> bool:
        node = self.nodes(role).get(rank)
        if node is None or node.done or node.ready:
            return False
        node.ready = True
        return True

    def not_ready(self, role: str) -> list[int]:
        return [r for r in self.running(role) if not self.nodes(role)[r].ready]

    # ------------------------------------------------------------------ Server
    def batchers(self) -> dict[str, AtomBatcher]:
        """The running workers' batchers (a killed worker's never step again)."""
        return {f"{role}{r}": self.nodes(role)[r].worker.batcher
                for role in ("decode", "prefill") for r in self.running(role)}

    def decode_workers(self) -> dict[str, workers.DecodeWorker]:
        return {f"decode{r}": self.c.decodes[r].worker for r in self.running("decode")}

    def submit(self, it: Item) -> int:
        from atom_core.simulate.checks.cluster import assignment_problems

        hits = self.router.affinity_hits["prefill"]
        cid = self.c.submit(list(it.prompt), it.max_new_tokens, it.eos)
        self.problems += assignment_problems(self, cid, hits)
        r = self.fe.results[cid]
        self.down_at_submit[cid] = self.down.get(("decode", r.decode), 0)
        if r.prefill is not None:
            self.sent[r.prefill].update(self.router.prefix_keys(r.prompt))
        if not r.ended:
            self.open.add(cid)
        return cid

    def abort(self, cid: int) -> bool:
        # asynchronous: the request ends at a later tick ("aborted", or as it was ending)
        if self.fe.abort(cid):
            self.aborted.add(cid)
            self.sim.count("abort")
        return False

    def tick(self) -> list[tuple[int, str]]:
        waiting = {r: self.c.prefills[r].worker.stats.requests
                   for r in self.not_ready("prefill")}
        self.c.step()
        for r, asked in waiting.items():
            got = self.c.prefills[r].worker.stats.requests - asked
            if got:
                self.problems.append(f"prefill worker {r} was asked for {got} prefills before "
                                     "it reported ready")
        out = []
        for cid in sorted(self.open):
            r = self.fe.results[cid]
            if r.ended:
                self.open.discard(cid)
                kind = "finished" if r.error is None else \
                    "abort" if r.error == "aborted" else "error"
                out.append((cid, kind))
        return out

    def result(self, cid: int) -> tuple[list[int], str | None]:
        r = self.fe.results[cid]
        return list(r.tokens), r.error

    def idle(self) -> bool:
        return not self.fe.busy() and not any(
            n.worker.batcher.busy() or (hasattr(n.links, "busy") and n.links.busy())
            for n in self.c.live())

    def at_rest(self) -> dict[str, AtomBatcher]:
        return self.batchers()

    def counters(self) -> dict[str, int]:
        """What the run exercised (a report field: equal for equal seeds)."""
        decodes = [n for n in self.every if isinstance(n.worker, workers.DecodeWorker)]
        prefills = [n for n in self.every if isinstance(n.worker, workers.PrefillWorker)]
        return {**self.counts,
                "retried": sum(n.links.retried for n in decodes),
                "busy_refused": sum(n.worker.stats.refused_busy for n in prefills),
                "busy_retried": sum(n.links.busy_retried for n in decodes),
                "busy_local": sum(n.busy_local for n in decodes),
                "resubmitted": sum(n.resubmitted for n in decodes),
                "local_fallbacks": sum(n.worker.local_fallbacks for n in decodes),
                "exports": sum(n.worker.stats.exports for n in prefills),
                "affinity_hits": self.router.affinity_hits["prefill"],
                "late_events": self.fe.late_events}

    @property
    def alive(self) -> bool:
        return False  # no link to fault


Server = Colocated | Disaggregated | Clustered
