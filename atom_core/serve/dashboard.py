"""`/dashboard`: a live page of the server's lanes, blocks, queue, prefix cache, host tier, recent
events and throughput, for a person to watch while it serves. Read-only: two GET routes.

- `/dashboard`: the page (`dashboard_page.py`): static, the same bytes for everyone, no data in
  it, so it is the one path besides /health that needs no key (a browser cannot send an
  Authorization header when it opens a URL): `PageMiddleware` answers it before the key check.
  Its script asks for the key once (kept in the tab's sessionStorage; or `/dashboard#key=...`,
  whose fragment never reaches the server or its logs) and sends it as `Authorization: Bearer`
  with every poll.
- `/state` (the server's own) and `/dashboard/live`, both behind the API key like every other
  path: the page draws lanes, blocks, queue, cache entries and host tier from `/state`, and
  from `/dashboard/live` what `/state` does not say: each running request's phase, each cache
  entry's hits, the recent events, the latency sums and the engine's step count.

Hits and events come from a listener on the batcher's transitions (`Recorder`), which runs on
the engine thread, as the live view is read (`Engine.call`): no lock, and a consistent view."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections import deque
from typing import Any

from fastapi import FastAPI
from starlette.responses import HTMLResponse

from atom_core._generated import core
from atom_core.serve.dashboard_page import SCRIPT, STYLE, page_html

PAGE_PATH = "/dashboard"
LIVE_PATH = "/dashboard/live"
KEEP_EVENTS = 200  # recent events kept (the page shows them newest first)


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


# The page may run its own script and style and talk to this server, nothing else: no CDN, no
# other origin, no framing, no form posts (a header, not a promise in a comment). Its icon is
# an empty data: URL, so that the browser does not ask for /favicon.ico (a 401 without a key).
HEADERS = {
    "Content-Security-Policy": (f"default-src 'none'; script-src {_sha256(SCRIPT)}; "
                                f"style-src {_sha256(STYLE)}; connect-src 'self'; "
                                "img-src data:; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
PAGE = page_html()


class PageMiddleware:
    """Answers GET (and HEAD) /dashboard with the static page, ahead of the API key check (the
    app's outermost middleware); every other request goes on as it came."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == PAGE_PATH and \
                scope["method"] in ("GET", "HEAD"):
            await HTMLResponse(PAGE, headers=HEADERS)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class Recorder:
    """Called with the effects of every transition of the batcher (its scheduler's listeners),
    on the engine thread: counts each prefix-cache entry's hits and keeps the recent events
    (admissions, hits, evictions, spills, preemptions, ends). `view` is the live core state,
    read right after the transition the effects came from."""

    def __init__(self, view: Any, tables: list[list[int]], keep: int = KEEP_EVENTS) -> None:
        self.view = view
        self.hits: dict[int, int] = {}  # cache entry (its block) -> hits since it was made
        self.events: deque[dict[str, Any]] = deque(maxlen=keep)
        self.lengths = list(view.length)  # each lane's length before the transition
        # each lane's blocks, kept from the effects as the scheduler keeps its tables (a
        # release names only the lane's tail block, and the lane's other blocks go with it)
        self.tables = [list(t) for t in tables]
        self.seq = 0

    def _event(self, kind: str, text: str) -> None:
        self.seq += 1
        self.events.append({"seq": self.seq, "time": time.time(), "kind": kind, "text": text})

    def __call__(self, effects: Any) -> None:
        v = self.view
        if effects:
            # a hit copies or loads; an entry a lane takes without either, its KV kept (its
            # length grew at once), was taken over: a hit too; any other reuse evicts it
            moved = any(isinstance(e, (core.Copy, core.Load)) for e in effects)
            released: dict[int, list[int]] = {}
            for e in effects:
                if isinstance(e, (core.Admit, core.Grow)):
                    self._took(e.lane, e.block, moved)
                    if isinstance(e, core.Admit):
                        self.tables[e.lane] = [e.block]
                        self._event("admit", f"lane {e.lane} admits r{e.request} "
                                             f"(block {e.block})")
                    else:
                        self.tables[e.lane].append(e.block)
                elif isinstance(e, core.Copy):
                    self.hits[e.src] = self.hits.get(e.src, 0) + 1
                    self._event("hit", f"lane {e.lane}: prefix hit, {e.n} tokens copied from "
                                       f"the entry in block {e.src}")
                elif isinstance(e, core.Load):
                    self._event("hit", f"lane {e.lane}: host hit, {e.n} tokens loaded from "
                                       f"slot {e.slot}")
                elif isinstance(e, core.Preempt):
                    self.tables[e.lane] = []
                    self._event("preempt", f"lane {e.lane} preempted: r{e.request} waits "
                                           "again")
                elif isinstance(e, core.Store):
                    self.hits.pop(e.block, None)
                    self._event("spill", f"the entry in block {e.block} spilled to host slot "
                                         f"{e.slot}")
                elif isinstance(e, core.Release):
                    released[e.lane] = self.tables[e.lane] or [e.block]
                    self.tables[e.lane] = []
                elif isinstance(e, core.Outbound):
                    self._event("export", f"lane {e.lane}: r{e.request}'s KV goes to a decode "
                                          "worker")
                elif isinstance(e, core.Inbound):
                    self.tables[e.lane] = [e.block]
                    self._event("admit", f"lane {e.lane} imports r{e.request}'s KV")
            for lane, blocks in released.items():
                kept = [b for b in blocks if v.owner[b] == core.OWNER_CACHE]
                for b in kept:
                    self.hits[b] = 0
                self._event("end", f"lane {lane} ended: {len(blocks)} block(s) released"
                            + (f", {len(kept)} kept as cache entries" if kept else ""))
        self.lengths[:] = v.length

    def _took(self, lane: int, block: int, moved: bool) -> None:
        """A lane took `block`: if it was a cache entry, taken over (a hit) or evicted."""
        if block not in self.hits:
            return
        n = self.hits.pop(block)
        if not moved and self.view.length[lane] > self.lengths[lane]:
            self._event("hit", f"lane {lane} takes over the entry in block {block} (its KV "
                               f"kept; {n} earlier hits)")
        else:
            self._event("evict", f"the entry in block {block} evicted after {n} hits")

    def live(self, _batcher: Any = None) -> dict[str, Any]:
        """The live view (on the engine thread, between two steps): each busy lane's request's
        phase, each cache entry's hits, the recent events. Entries gone without an effect (a
        discard) are dropped here."""
        v = self.view
        for b in [b for b in self.hits if v.owner[b] != core.OWNER_CACHE]:
            del self.hits[b]
        phases = {str(v.lane_req[ln]): core.PHASE_NAMES[v.phase.get(v.lane_req[ln],
                                                                     core.PHASE_NONE)].lower()
                  for ln in range(v.consts.B) if v.busy[ln]}
        return {"phases": phases, "hits": {str(b): n for b, n in sorted(self.hits.items())},
                "events": list(self.events)}


def register(app: FastAPI, engine: Any, metrics: Any, model_name: str) -> Recorder:
    """Add the dashboard to `app` (after its other middleware: the page is answered first) and
    its listener to the engine's batcher (before the engine starts: the listener list is the
    engine thread's)."""
    batcher = engine.batcher
    recorder = Recorder(batcher.scheduler.view, batcher.scheduler.tables)
    batcher.scheduler.listeners.append(recorder)
    cfg = batcher.config
    config = {"lanes": cfg.lanes, "kv_blocks": cfg.kv_blocks, "block_size": cfg.block_size,
              "max_seq_len": cfg.max_seq_len, "prefix_cache": cfg.prefix_cache,
              "host_cache_blocks": cfg.host_cache_blocks}

    app.add_middleware(PageMiddleware)

    @app.get(LIVE_PATH, include_in_schema=False)
    async def dashboard_live() -> dict[str, Any]:
        view = await asyncio.to_thread(engine.call, recorder.live)
        # the latency histograms are observed on the event loop, where this runs
        return {**view, "now": time.time(), "model": model_name, "config": config,
                "engine_steps": engine.steps,
                "latency": {"ttft_sum": metrics.ttft.sum, "ttft_count": sum(metrics.ttft.counts),
                            "itl_sum": metrics.itl.sum, "itl_count": sum(metrics.itl.counts)}}

    return recorder
