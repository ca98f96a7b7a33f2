"""A PD cluster across processes: one per worker, plus the frontend (the router), over gloo.

Ranks: 0 is the frontend (it runs the router and the workload), 1..N the prefill workers, N+1..
N+M the decode workers. All of them join one torch.distributed store (rank 0 hosts it on
--host:--port; under `torchrun` the agent's store at MASTER_ADDR:MASTER_PORT), and every pair
that talks (frontend-worker, decode-prefill) gets its own two-rank gloo group on that store,
under a prefix naming both ends and their generations: a link is a `GlooTransport` (its
threads, limits and failure semantics), wrapped in its own `SecureLink` when there is a key.
Pair groups rather than one world group so that a process that dies ends only its own links,
and one that starts late or restarts gets new ones.

Each process counts its start in the store (`gen/<rank>`, so a restart is a new generation)
and a `Linker` thread builds a link to every peer it should talk to whenever that peer's
generation is new (each link in a thread of its own: the gloo group's constructor blocks until
both ends join). A worker reports ready once it has tried every peer registered so far.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time
from typing import Any

import attrs

from atom_core.pd.cluster_store import (
    LinkAborted,
    StoreSeal,
    TamperLog,
    allocate_generation,
    link_store,
    peek,
    read_generation,
    record,
)
from atom_core.pd.links import IDLE_POLL
from atom_core.pd.transport import (
    GlooTransport,
    Transport,
    TransportError,
    listen_fd,
    resolve_address,
    source_address,
)

__all__ = ["Layout", "Linker", "open_store"]

log = logging.getLogger(__name__)

BACKENDS = ("gloo",)
# How often the linker looks for new peers or restarted ones in the store.
SCAN_SECONDS = 0.2


@attrs.frozen
class Layout:
    """Which rank is which worker."""

    prefill: int
    decode: int

    @property
    def world(self) -> int:
        return 1 + self.prefill + self.decode

    def role(self, rank: int) -> tuple[str, int]:
        if rank == 0:
            return "frontend", 0
        if 1 <= rank <= self.prefill:
            return "prefill", rank - 1
        if rank < self.world:
            return "decode", rank - 1 - self.prefill
        raise ValueError(f"rank {rank} is outside the cluster (world size {self.world}: 1 "
                         f"frontend, {self.prefill} prefill, {self.decode} decode)")

    def rank(self, role: str, index: int) -> int:
        return index + 1 if role == "prefill" else 1 + self.prefill + index

    def peers(self, rank: int) -> list[int]:
        """The ranks `rank` talks to."""
        role, _ = self.role(rank)
        prefill = [self.rank("prefill", i) for i in range(self.prefill)]
        decode = [self.rank("decode", i) for i in range(self.decode)]
        return {"frontend": prefill + decode, "prefill": [0] + decode,
                "decode": [0] + prefill}[role]


def open_store(host: str, port: int, rank: int, timeout: float) -> Any:
    """The cluster's store: rank 0 hosts it (listening on `host` only), the others connect,
    retrying until `timeout`; under torchrun every rank connects to the agent's store."""
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    where = f"{host}:{port}"
    family, addr = resolve_address(host, port)
    if rank != 0 or agent:
        try:
            return dist.TCPStore(addr, port, None, False, timeout=td)
        except (RuntimeError, OSError) as exc:
            raise TransportError(f"rank {rank} could not reach the cluster's store at {where} "
                                 f"within {timeout:g}s ({exc}): start rank 0 (the frontend) "
                                 "with the same --host and --port") from exc
    fd = listen_fd(family, addr, port, where, backlog=64)
    return dist.TCPStore(addr, port, None, True, timeout=td, wait_for_workers=False,
                         master_listen_fd=fd)


def initiates(layout: Layout, rank: int, peer: int) -> bool:
    """`rank` is its link's rank 0 and starts the key handshake: the frontend with everyone,
    a decode worker with a prefill worker (as in a PD pair)."""
    return rank == 0 or (peer != 0 and layout.role(rank)[0] == "decode")


class Linker:
    """Builds `rank`'s links to its peers as they (re)register; finished links come out of
    `links` as (peer rank, link), and `generation(link)` then names the peer's generation it
    goes to. `limits(peer)`: the link's frame limits (GlooTransport's max_header_bytes,
    max_tensor_bytes). `timeout`: the store's and gloo's own operations (a send, a close);
    `link_timeout` (default `timeout`): how long a link's rendezvous and key handshake wait for
    the peer (a loaded machine starts its processes slowly).

    What it reads from the store is authenticated (`atom_core.pd.cluster_store`): a peer's
    generation is the one its sealed record names, so a keyless writer's garbage, bump or
    forgery is ignored (logged once per key) and can neither hide a peer nor make a real link
    stale. Its threads never die silently: a store that keeps failing for `timeout` ends the
    scan with `failed` set (the process then exits saying so), a link that fails is logged."""

    def __init__(self, store: Any, layout: Layout, rank: int, *, host: str, port: int,
                 timeout: float, key: bytes | None, limits: Any,
                 link_timeout: float | None = None) -> None:
        self.store, self.layout, self.rank = store, layout, rank
        self.host, self.timeout, self.key, self.limits = host, timeout, key, limits
        self.link_timeout = timeout if link_timeout is None else link_timeout
        self._where = f"{host}:{port}"
        family, addr = resolve_address(host, port)
        self._addr, self._port = addr, port
        # the address the peers reach this process on: the one that routes to the store's host
        self.local = addr if rank == 0 else source_address(family, addr, port)
        self.seal = StoreSeal(key)
        self.tamper = TamperLog(f"rank {rank}")
        self.gen = allocate_generation(store, rank, self.seal, self.tamper)
        self._record = self.seal.seal(f"node/{rank}", record(rank, self.gen))
        store.set(f"node/{rank}", self._record)
        self.links: queue.Queue[tuple[int, Transport]] = queue.Queue()
        self._gen_of: dict[int, int] = {}  # id(link) -> the peer generation it goes to
        self._lock = threading.Lock()
        self._seen: dict[int, int] = {}  # peer -> its latest authentic generation
        self._tried: dict[int, int] = {}  # peer -> the generation last built or failed
        # (peer, generation) being built: a build for a peer's dead generation may block until
        # `link_timeout`, and must not hold back the build for its new one
        self._building: set[tuple[int, int]] = set()
        self._stop = threading.Event()
        self.failed: str | None = None  # why the scan ended on its own (the store failed)
        self._thread = threading.Thread(target=self._scan, daemon=True,
                                        name=f"cluster-linker-r{rank}")
        self._builders: list[threading.Thread] = []

    def generation(self, link: Transport) -> int | None:
        """The generation of the peer a link taken from `links` goes to (once per link)."""
        with self._lock:
            return self._gen_of.pop(id(link), None)

    def start(self) -> Linker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def close(self, timeout: float = 5.0) -> bool:
        """Stop, give the scan and every link build up to `timeout` seconds to end (a build
        waiting on the store or the handshake ends at once; one inside gloo's connect only by
        gloo's timeout), and close the links built but not taken. True when every thread
        ended: a thread left inside gloo must not meet the interpreter's exit (a C++
        terminate), see `threads_left`."""
        self.stop()
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = [self._thread, *self._builders]
        for t in threads:
            if t.ident is not None:  # (started)
                t.join(max(0.0, deadline - time.monotonic()))
        for _, link in _take(self):
            link.close()
        return not any(t.is_alive() for t in threads)

    def settled(self) -> bool:
        """Every peer registered so far was tried (linked or failed) at its latest generation."""
        with self._lock:
            return all(self._tried.get(p, 0) >= g for p, g in self._seen.items())

    def _scan(self) -> None:
        broken: float | None = None  # since when the store fails
        while not self._stop.is_set():
            try:
                self._scan_once()
                broken = None
            except Exception as exc:  # noqa: BLE001 - logged; retried until `timeout`
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                now = time.monotonic()
                if broken is None:
                    broken = now
                    log.warning("rank %d: the cluster store at %s failed (%s); retrying for "
                                "%gs", self.rank, self._where, why, self.timeout)
                elif now - broken > self.timeout:
                    self.failed = (f"rank {self.rank}: the cluster store at {self._where} kept "
                                   f"failing for {self.timeout:g}s ({why}): the frontend (rank "
                                   "0, its host) ended or cannot be reached")
                    log.error("%s", self.failed)
                    return
            self._stop.wait(SCAN_SECONDS)

    def _scan_once(self) -> None:
        mine = f"node/{self.rank}"
        if peek(self.store, mine) != self._record:
            # overwritten or deleted by a keyless writer: the peers must find this process
            self.tamper.note(mine, "this process's own record was replaced or deleted",
                             done="wrote back")
            self.store.set(mine, self._record)
        for peer in self.layout.peers(self.rank):
            g = read_generation(self.store, peer, self.seal, self.tamper)
            if g is None:
                continue
            with self._lock:
                seen = self._seen.get(peer, 0)
                if g >= seen:
                    self._seen[peer] = g
                new = g >= seen and self._tried.get(peer, 0) < g \
                    and (peer, g) not in self._building
                if new:
                    self._building.add((peer, g))
                    t = threading.Thread(target=self._build, args=(peer, g), daemon=True,
                                         name=f"cluster-link-r{self.rank}-r{peer}")
                    self._builders = [b for b in self._builders if b.is_alive()] + [t]
                    t.start()
            if g < seen:
                # an older authentic record again: a replay (never a restart, which counts up)
                self.tamper.note(f"node/{peer}", f"generation {g} again after {seen}")

    def _build(self, peer: int, g: int) -> None:
        first = initiates(self.layout, self.rank, peer)
        me, them = (self.rank, self.gen), (peer, g)
        lo, hi = (me, them) if first else (them, me)  # both ends name it alike
        prefix = f"link/{lo[0]}.{lo[1]}/{hi[0]}.{hi[1]}/"
        link: Transport | None = None
        try:
            link = self._connect(first, peer, prefix)
        except LinkAborted:
            pass  # stopping: nothing to say
        except Exception as exc:  # noqa: BLE001 - a failed link ends here, said once
            if not self._stop.is_set():
                text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.warning("rank %d: no link with rank %d (generation %d): %s", self.rank,
                            peer, g, text)
        with self._lock:
            self._building.discard((peer, g))
            stale = g < self._seen.get(peer, g)  # the peer restarted meanwhile
            self._tried[peer] = max(g, self._tried.get(peer, 0))
        if link is not None and (stale or self._stop.is_set()):
            # to a generation that is gone (it would only replace the new link), or built
            # while stopping (nobody takes it)
            link.close()
        elif link is not None:
            with self._lock:
                self._gen_of[id(link)] = g
            self.links.put((peer, link))

    def _connect(self, first: bool, peer: int, prefix: str) -> Transport:
        import torch.distributed as dist

        # A connection of its own: a store client serves one call at a time, and the group's
        # rendezvous waits in it until the peer joins (up to `link_timeout` for a dead one),
        # which must not hold up the scan or the other links.
        own = dist.TCPStore(self._addr, self._port, None, False,
                            timeout=datetime.timedelta(seconds=self.timeout))
        store = link_store(own, prefix, self.seal, self.tamper, self._stop, self.link_timeout)
        link: Transport = GlooTransport(
            0 if first else 1, host=self.host, local_host=self.local, timeout=self.timeout,
            store=store, **self.limits(peer))
        if self.key is None:
            return link
        from atom_core.pd.secure_link import SecureLink

        # the label names both ends and generations: a relay of another link's handshake (a
        # control link's included) fails it
        secure = SecureLink(link, self.key, "decode" if first else "prefill", label=prefix,
                            max_box_bytes=self.limits(peer)["max_tensor_bytes"],
                            handshake_timeout=self.link_timeout)
        try:
            secure.establish(self.link_timeout, stop=self._stop)
        except TransportError:
            secure.close()
            raise
        return secure


def threads_left() -> list[str]:
    """Names of this process's threads that may be inside gloo or the store's C++ (link
    builds, link transports) and still run: the interpreter's exit under such a thread ends
    in a C++ `terminate` (an abort and a core), so the CLI then leaves with `os._exit`."""
    return sorted(t.name for t in threading.enumerate()
                  if t.is_alive() and t.name.startswith(("cluster-link", "gloo-transport")))


def wait_for(cond: Any, timeout: float, what: Any, pump: Any = None) -> None:
    """Call `pump()` until `cond()` or raise TimeoutError naming `what` (a string, or a
    function giving it at that moment)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if pump is not None:
            pump()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what() if callable(what) else what} within {timeout:g}s")
        time.sleep(0.01)


def link_limits(cfg: Any, rt: Any) -> dict[str, int]:
    """Frame limits for every link of a process: a KV payload of `cfg` sealed in a box, or a
    control message (atom_core.pd.cluster.CONTROL_BYTES), whichever is larger."""
    from atom_core.pd import payload as pd
    from atom_core.pd.cluster import CONTROL_BYTES

    lim = pd.frame_limits(cfg, rt)
    header = max(lim.header_bytes, CONTROL_BYTES)
    return {"max_header_bytes": header, "max_tensor_bytes": header + lim.tensor_bytes + 4096}


def _take(linker: Linker) -> list[tuple[int, Transport, int | None]]:
    out = []
    while True:
        try:
            peer, link = linker.links.get_nowait()
            out.append((peer, link, linker.generation(link)))
        except queue.Empty:
            return out


def run_worker(layout: Layout, rank: int, *, host: str, port: int, timeout: float, cfg: Any,
               rt: Any, key: bytes | None, prefetch: int = 0, transfer_timeout: float = 30.0,
               link_timeout: float | None = None) -> dict[str, Any]:
    """Rank `rank`'s worker until the frontend says shutdown (or is lost); its stats.
    `link_timeout` (default `timeout`): how long start-up waits for the store and for the link
    with the frontend. On any error every link and link build is closed before it is raised
    (threads left inside gloo: `threads_left`)."""
    from atom_core.pd.cluster import DecodeNode, PrefillNode, _wait
    from atom_core.pd.links import DecodeLinks, PrefillLinks
    from atom_core.pd.workers import DecodeWorker, PrefillWorker

    link_timeout = timeout if link_timeout is None else link_timeout
    role, index = layout.role(rank)
    store = open_store(host, port, rank, link_timeout)
    limits = link_limits(cfg, rt)
    linker = Linker(store, layout, rank, host=host, port=port, timeout=timeout, key=key,
                    limits=lambda peer: limits, link_timeout=link_timeout).start()
    got: list[tuple[int, Transport, int | None]] = []
    node: Any = None

    def take() -> None:
        if linker.failed is not None:
            raise TransportError(linker.failed)
        got.extend(_take(linker))

    try:
        try:
            wait_for(lambda: any(p == 0 for p, _, _ in got), link_timeout,
                     f"rank {rank} ({role} {index}): no link with the frontend (rank 0)", take)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc} (the link timeout: a loaded machine may need a longer "
                               "one)") from None
        control = next(link for p, link, _ in got if p == 0)
        if role == "prefill":
            dlinks = DecodeLinks(secure=key is not None)
            node = PrefillNode(index, PrefillWorker(cfg, rt, dlinks, key=key,
                                                    insecure=key is None),
                               dlinks, control, gen=linker.gen)
        else:
            plinks = PrefillLinks(secure=key is not None)
            node = DecodeNode(index, DecodeWorker(cfg, rt, plinks, key=key, insecure=key is None,
                                                  prefetch=prefetch,
                                                  transfer_timeout=transfer_timeout,
                                                  wire_prefix=f"d{index}g{linker.gen}."),
                              plinks, control, gen=linker.gen)
        while not node.done:
            for peer, link, g in [*got, *_take(linker)]:
                if peer == 0 and link is not control:
                    link.close()  # one frontend per cluster: a second one is not served
                elif peer != 0:
                    # with its generation: a restarted prefill worker is asked nothing until
                    # the frontend names this generation ready (`PrefillLinks.set_ready`)
                    node.links.add(layout.role(peer)[1], link, gen=g)
            got = []
            node.ready = linker.settled()
            if not node.step():
                _wait(node, 0.02)  # (returns at the first message)
    finally:
        linker.close()
        if node is not None:
            node.close()
        for _, link, _ in got:  # (taken, not yet the node's)
            link.close()
    st = node.worker.batcher.stats
    return {"rank": rank, "role": role, "index": index, "prefill_tokens": st.prefill_tokens,
            "prefix_hit_tokens": st.prefix_hit_tokens, "imported_tokens": st.imported_tokens,
            "generated_tokens": st.generated_tokens, "exports": st.exports}


class FrontendProcess:
    """Rank 0: the store's host, the frontend, and its links to every worker."""

    def __init__(self, layout: Layout, *, host: str, port: int, timeout: float, cfg: Any,
                 rt: Any, key: bytes | None, policy: Any = None,
                 link_timeout: float | None = None) -> None:
        """`link_timeout` (default `timeout`): how long a link's rendezvous and `wait_ready`
        wait for the workers (a loaded machine starts them slowly)."""
        from atom_core.pd.cluster import Frontend, prefix_unit
        from atom_core.pd.router import Router
        from atom_core.runtime.protocol import capabilities

        self.layout, self.timeout = layout, timeout
        self.link_timeout = timeout if link_timeout is None else link_timeout
        self.store = open_store(host, port, 0, timeout)
        limits = link_limits(cfg, rt)
        self.linker = Linker(self.store, layout, 0, host=host, port=port, timeout=timeout,
                             key=key, limits=lambda peer: limits,
                             link_timeout=self.link_timeout).start()
        # a request message larger than its link's header limit would end the decode
        # worker's control link: the frontend refuses it instead
        self.frontend = Frontend(Router(prefix_unit(cfg), policy),
                                 max_request_bytes=limits["max_header_bytes"],
                                 vocab_size=capabilities(rt).vocab_size)

    def pump(self) -> bool:
        """Take new links, then one frontend step; False when nothing happened."""
        for peer, link, _ in _take(self.linker):
            self.frontend.add(*self.layout.role(peer), link)
        return self.frontend.step()

    def wait_ready(self, check: Any = None) -> None:
        """Until every worker reported ready; `check()` may raise to give up sooner (a worker
        process that exited)."""
        r = self.frontend.router

        def pump() -> None:
            if check is not None:
                check()
            if self.linker.failed is not None:
                raise TransportError(self.linker.failed)
            self.pump()

        wait_for(lambda: len(r.ready("prefill")) == self.layout.prefill
                 and len(r.ready("decode")) == self.layout.decode, self.link_timeout,
                 lambda: f"not every worker ({self.layout.prefill} prefill, "
                         f"{self.layout.decode} decode) reported ready: ready are prefill "
                         f"{r.ready('prefill')}, decode {r.ready('decode')}", pump)

    def run(self, each: Any = None, timeout: float | None = None) -> None:
        """Until every submitted request ended; `each()` runs every round (faults)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0001
        while self.frontend.busy():
            if each is not None:
                each()
            if self.pump():
                pause = 0.0001
            else:  # idle: look again soon, then less often (the workers need the cores)
                time.sleep(pause)
                pause = min(2 * pause, IDLE_POLL)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"requests still running after {timeout:g}s: "
                                   f"{sorted(self.frontend._open)[:20]}")

    def close(self) -> None:
        self.linker.close()
        self.frontend.close()
