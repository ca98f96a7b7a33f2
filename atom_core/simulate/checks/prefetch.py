"""Host memory a server holds for requests: a PD decode worker's prefetched KV."""

from __future__ import annotations

from atom_core._generated import core
from atom_core.simulate.servers import Server


def prefetch_leaks(server: Server) -> list[str]:
    """Prefetched KV is held in host memory only while its request waits for a lane, or for the
    rest of its table (an import whose table still grows); on every running decode worker. A
    colocated server prefetches nothing."""
    out = []
    for side, dw in server.decode_workers().items():
        b = dw.batcher
        for wid, req in dw.requests.items():
            if req.payload is None:
                continue
            ph = None if req.brid is None else b.phase(req.brid)
            growing = ph == core.PHASE_IMPORTING and not b.awaits_kv(req.brid)
            if ph != core.PHASE_WAITING and not growing:
                who = "decode worker" if side == "decode" else side
                out.append(f"{who} holds prefetched KV of request {wid}, which no longer "
                           "waits")
    return out
