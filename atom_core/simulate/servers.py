"""The servers a run drives: one colocated batcher, or a PD prefill worker feeding a decode
worker over an in-process link (`Server`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atom_core import pdlink, workers
from atom_core.batcher import AtomBatcher
from atom_core.simulate.faulty_link import SimLink
from atom_core.simulate.workload import Item
from atom_core.transport import InProcessTransport

if TYPE_CHECKING:
    from atom_core.simulate.driver import Sim

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
        self.b = AtomBatcher(conf, self.runtimes["local"], ghost=True)
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
        dlink = pdlink.SecureLink(self.links["decode"], SIM_KEY, "decode", clock=sim.clock)
        plink = pdlink.SecureLink(self.links["prefill"], SIM_KEY, "prefill", clock=sim.clock)
        pdlink.establish_pair(dlink, plink)
        self.pw = workers.PrefillWorker(pconf, self.runtimes["prefill"], plink, key=SIM_KEY,
                                        ghost=True)
        self.dw = workers.DecodeWorker(dconf, self.runtimes["decode"], dlink, key=SIM_KEY,
                                       fallback_local=bool(cfg.fallback_local),
                                       transfer_timeout=TRANSFER_TIMEOUT,
                                       prefetch=cfg.prefetch or 0, ghost=True, clock=sim.clock)

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

    @property
    def alive(self) -> bool:
        return self.links["prefill"].alive


Server = Colocated | Disaggregated
