"""Message transports between a PD prefill worker and a decode worker.

A message is `(header, tensor)`: `header` a JSON-serializable dict (request ids, prompt tokens,
checksums; small), `tensor` an optional CPU tensor (a KV payload, up to tens of MB). Both ways are
used: decode -> prefill sends `{"kind": "prefill", ...}` requests, prefill -> decode sends
`{"kind": "kv", ...}` with the KV. Neither side's serving loop ever waits for the other: `send`
copies the message and returns, `poll` hands over what has arrived and never blocks, `wait` is
the one call that blocks, for as long as the caller says.

The receiver gets the header's JSON round trip (tuples become lists, keys become strings) and a
tensor of its own (contiguous, same dtype and shape, no autograd history): nothing a receiver
holds aliases the sender's memory. Header kinds "bye" and "peer_lost" are reserved for the
transport. Stats: `messages_sent`, `messages_received`, `bytes_sent`, `bytes_received` (header
JSON plus tensor bytes, framing excluded), `sends_pending`; transport control messages are not
counted.

Failure semantics (both transports). When the peer dies, the connection breaks or the peer
closes, `poll` returns the messages that fully arrived before, then exactly once
`({"kind": "peer_lost", "error": why}, None)`. `alive` is False from the moment the loss is
detected (so possibly before that poll), `send` then raises `TransportError`, and `wait` no longer
blocks once the inbox is empty. A message that was queued but not fully received is lost: the
caller must treat every transfer still in flight as failed (fail or re-issue those requests).
Closing locally is not a loss: it reports nothing to the closing side.

`InProcessTransport.pair()` is two ends joined by locked queues, for tests and the single-process
simulation, with fault hooks on the sending end: `hold`/`release` (keep messages in flight),
`drop_next` (silently lose messages), `kill` (the end dies; its peer sees peer_lost).

`GlooTransport` is torch.distributed's gloo backend, world size 2, point-to-point send/recv on
its own `ProcessGroupGloo` (not the global default group, so a process can open and close
transports one after another and the rest of the process's torch.distributed use is untouched).

- Rendezvous: rank 0 (the decode worker) hosts a `TCPStore` on (host, port); rank 1 (the prefill
  worker) connects to it, retrying until `timeout`, so either may start first. The store's own
  listener binds all interfaces, so rank 0 binds the socket itself on `host` and hands it over.
  Gloo's data connection binds `host` on rank 0 and, on rank 1, the local address that routes
  to `host` (`local_host` overrides it): with the default host 127.0.0.1 nothing listens beyond
  loopback.
- Two hosts: on the decode host `GlooTransport(0, host=<decode host's address>, port=P)`, on
  the prefill host `GlooTransport(1, host=<the same address>, port=P)`, and open P plus the
  ephemeral ports gloo listens on between the two hosts only. Nothing here authenticates the
  peer: anyone who reaches the port during the rendezvous can take rank 1's place, so the
  workers run over `atom_core.pd.secure_link.SecureLink` (a key handshake, then every message
  sealed).
- Limits: a received meta announcing a header above `max_header_bytes` or a tensor above
  `max_tensor_bytes` (the worker's `pd.frame_limits`) ends the link before anything is allocated
  for it; the inbox holds at most `inbox_messages` (gloo: the receiver then stops reading, so the
  peer's send times out; in-process: the link is lost). A "peer_lost" header from the wire is
  dropped (`reserved_dropped`): only this end reports a loss.
- Wire format, per message, each part a gloo send on tag 1000 + sender's rank (one tag per
  direction): an int64 tensor `[header_nbytes, tensor_nbytes, dtype_code, ndim]` (dtype_code 0:
  no tensor), the header's UTF-8 JSON as uint8, then if there is a tensor its shape as int64
  (skipped when ndim is 0) and its bytes as uint8 (skipped when empty), so every dtype travels as
  raw bytes in the host's byte order and is rebuilt with `view(dtype).reshape(shape)`.
- Threads: gloo send/recv complete on gloo's own I/O thread and release the GIL, and a thread
  blocked in recv does not stop another from sending on the same group. Each transport runs one
  receiver thread (recv in a loop, into the inbox) and one sender thread (drains an outbound
  queue), both daemons. So the receiver drains the socket whatever the serving loop is doing (a
  gloo send completes only once the peer has posted the matching recv: without the thread a
  busy receiver would stall the sender), and a multi-MB send never blocks the caller. `flush`
  waits for the outbound queue to empty.
- Timeouts: `timeout` bounds the rendezvous, each part of a send and `close`. The receiver's
  recv waits without a practical bound: in gloo a timed-out wait poisons the whole connection,
  so an idle link must not time out. A dead peer process is seen at once (its kernel closes the
  socket); a silently partitioned network is not: the payload layer's deadlines cover that.
- Close: `close` sends a "bye" after everything queued, the peer's receiver answers with a "bye"
  of its own and reports peer_lost ("peer closed the connection"); the answer lets the closing
  side's receiver leave its recv, since gloo offers no way to interrupt one (neither
  `abort()` nor `shutdown()` of the group wakes it). A hung peer never takes the bye, so that
  send fails after `timeout`, which takes the link down and frees both threads. Should a thread
  still be inside gloo a second later, `close` leaves it (and the group it uses) to the
  process's exit and returns. From `close` on, what the receiver still takes is dropped, not
  queued: a peer that keeps sending instead of answering the bye cannot grow the inbox.
"""

from __future__ import annotations

import collections
import ctypes
import datetime
import ipaddress
import json
import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

import torch

__all__ = [
    "GlooTransport",
    "InProcessTransport",
    "Message",
    "Transport",
    "TransportError",
]

log = logging.getLogger(__name__)

Message = tuple[dict[str, Any], torch.Tensor | None]

PEER_LOST = "peer_lost"
_BYE = "bye"
_RESERVED_KINDS = frozenset({PEER_LOST, _BYE})
# Users cannot send kind "bye", so these exact bytes are always the transport's own.
_BYE_RAW = b'{"kind":"bye"}'

# Codes are part of the wire format: never renumber, only append.
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4,
    torch.int64: 5, torch.int32: 6, torch.int16: 7, torch.int8: 8, torch.uint8: 9,
    torch.bool: 10,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

# Sanity bounds on what a peer announces, so a corrupt meta is a protocol error, not an attempt
# to allocate petabytes.
_MAX_HEADER_BYTES = 64 << 20
_MAX_TENSOR_BYTES = 1 << 40
_MAX_NDIM = 64

_TAG_BASE = 1000
# The receiver's recv wait: gloo fails the whole context when a wait times out, so an idle
# connection must never time out. Ten years, well inside std::chrono's range.
_IDLE_WAIT = datetime.timedelta(days=3650)


class TransportError(RuntimeError):
    """A transport operation failed: the peer is gone, the transport is closed, or the
    connection could not be made. The message says what failed and what to do."""


@runtime_checkable
class Transport(Protocol):
    """One end of a message link between a prefill worker and a decode worker."""

    @property
    def alive(self) -> bool: ...

    @property
    def stats(self) -> dict[str, int]: ...

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None: ...

    def poll(self) -> list[Message]: ...

    def wait(self, timeout: float) -> bool: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...


# --- shared pieces ------------------------------------------------------------------------------

def _encode_header(header: Mapping[str, Any]) -> bytes:
    if not isinstance(header, Mapping):
        raise TypeError(f"a message header must be a dict, got {type(header).__name__}")
    if header.get("kind") in _RESERVED_KINDS:
        raise ValueError(f"header kind {header['kind']!r} is reserved for the transport's own "
                         "messages: use another kind")
    try:
        return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a message header must be JSON-serializable ({exc}): send ids, ints, "
                        "strings and lists, and ship arrays as the tensor") from exc


def _own_copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A contiguous CPU copy: the caller may reuse its buffer the moment `send` returns, and the
    receiver must never alias the sender's memory."""
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"a message tensor must be a torch.Tensor or None, got "
                        f"{type(tensor).__name__}")
    if tensor.dtype not in _DTYPE_CODES:
        names = ", ".join(str(d).removeprefix("torch.") for d in _DTYPE_CODES)
        raise TypeError(f"cannot send a {tensor.dtype} tensor: supported dtypes are {names}")
    if tensor.layout != torch.strided:
        raise TypeError(f"cannot send a {tensor.layout} tensor: convert it to a dense tensor")
    copy = torch.empty(tensor.shape, dtype=tensor.dtype)
    copy.copy_(tensor.detach())
    return copy


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _lost_message(why: str) -> Message:
    return {"kind": PEER_LOST, "error": why}, None


# Messages an inbox holds before its receiver waits (gloo: backpressure, the peer's send then
# times out and the link is lost) or the link is lost (in-process): never unbounded memory.
INBOX_MESSAGES = 1024


class _Inbox:
    """Received messages in order, then at most one peer_lost; `wait` wakes on either. Holds at
    most `max_messages` (see `put`)."""

    def __init__(self, max_messages: int = INBOX_MESSAGES) -> None:
        if not max_messages >= 1:
            raise ValueError(f"an inbox holds at least 1 message, got {max_messages}")
        self._cond = threading.Condition()
        self._items: collections.deque[Message] = collections.deque()
        self._ended = False
        self._discarding = False
        self._max: float = max_messages

    def put(self, message: Message, block: bool = True) -> bool:
        """Append `message`; when full, wait for the reader (`block`) or return False. After
        `end` or `discard` the message is dropped (True: nothing to retry)."""
        with self._cond:
            if block:
                self._cond.wait_for(lambda: len(self._items) < self._max or self._ended
                                    or self._discarding)
            if self._ended or self._discarding:
                return True
            if len(self._items) >= self._max:
                return False
            self._items.append(message)
            self._cond.notify_all()
            return True

    def discard(self) -> None:
        """From now on drop what is put (a closing transport: a receiver waiting for room must
        not hang in put, and nobody reads what arrives after close). Dropped, not queued: the
        receiver keeps reading until the peer's answering bye, and a peer that keeps sending
        instead (a hung or hostile one, for up to the close timeout) must not grow memory."""
        with self._cond:
            self._discarding = True
            self._cond.notify_all()

    def end(self, lost: str | None = None) -> bool:
        """No more messages; with `lost`, report it (only the first end reports)."""
        with self._cond:
            if self._ended:
                return False
            self._ended = True
            if lost is not None:
                self._items.append(_lost_message(lost))
            self._cond.notify_all()
            return True

    def drain(self) -> list[Message]:
        with self._cond:
            out = list(self._items)
            self._items.clear()
            self._cond.notify_all()  # a receiver waiting for room
            return out

    def wait(self, timeout: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: bool(self._items) or self._ended, max(0.0, timeout))
            return bool(self._items)


class _Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = {"messages_sent": 0, "messages_received": 0, "bytes_sent": 0,
                   "bytes_received": 0}

    def add(self, direction: str, nbytes: int) -> None:
        with self._lock:
            self._c[f"messages_{direction}"] += 1
            self._c[f"bytes_{direction}"] += nbytes

    def snapshot(self, **extra: int) -> dict[str, int]:
        with self._lock:
            return {**self._c, **extra}


# --- in-process ---------------------------------------------------------------------------------

class _Counted:
    """What both transports report the same way: alive, and the counters with the sends not
    yet shipped (each transport counts those its own way, under its lock)."""

    _alive: bool
    _lock: threading.Lock
    _stats: _Stats

    def _sends_pending(self) -> int:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            pending = self._sends_pending()
        return self._stats.snapshot(sends_pending=pending)


class InProcessTransport(_Counted):
    """One end of an in-process pair (`InProcessTransport.pair()`); thread-safe.

    Fault hooks act on what this end sends: `hold()` keeps every message sent afterwards in
    flight until `release()` delivers them in order; `drop_next(n)` silently loses the next n
    messages sent (held or not); `kill()` is this end dying: its held messages are lost, the peer
    sees peer_lost, and neither end is alive any more.
    """

    def __init__(self, _lock: threading.Lock, inbox_messages: int = INBOX_MESSAGES) -> None:
        # One lock for both ends: delivery, liveness and the hooks change together.
        self._lock = _lock
        self._peer: InProcessTransport | None = None
        self._inbox = _Inbox(inbox_messages)
        self._stats = _Stats()
        self._alive = True
        self._dead_why = ""
        self._held: list[tuple[bytes, torch.Tensor | None]] | None = None
        self._drop = 0

    @classmethod
    def pair(cls, inbox_messages: int = INBOX_MESSAGES
             ) -> tuple[InProcessTransport, InProcessTransport]:
        """Two joined ends; each holds at most `inbox_messages` unread messages, and one more
        loses the link (a reader that never keeps up must not grow memory without bound)."""
        lock = threading.Lock()
        a, b = cls(lock, inbox_messages), cls(lock, inbox_messages)
        a._peer, b._peer = b, a
        return a, b

    def _sends_pending(self) -> int:
        return len(self._held or ())

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        raw, copy = _encode_header(header), _own_copy(tensor)
        with self._lock:
            if not self._alive:
                raise TransportError(f"cannot send: {self._dead_why}")
            self._stats.add("sent", len(raw) + _nbytes(copy))
            if self._drop:
                self._drop -= 1
            elif self._held is not None:
                self._held.append((raw, copy))
            else:
                self._deliver(raw, copy)

    def _deliver(self, raw: bytes, tensor: torch.Tensor | None) -> None:
        # Called with the lock held; a dead peer's end takes nothing more.
        peer = self._peer
        assert peer is not None
        if peer._alive:
            if not peer._inbox.put((json.loads(raw), tensor), block=False):
                # both ends see the loss: the sender's inbox reports it too
                why = f"inbox full ({peer._inbox._max:g} unread messages): the reader did not " \
                      "keep up"
                self._alive, self._dead_why = False, f"the peer is gone ({why})"
                self._inbox.end(lost=why)
                self._end(self_why=why, peer_why=why)
                return
            peer._stats.add("received", len(raw) + _nbytes(tensor))

    def poll(self) -> list[Message]:
        return self._inbox.drain()

    def wait(self, timeout: float) -> bool:
        return self._inbox.wait(timeout)

    def hold(self) -> None:
        with self._lock:
            if self._held is None:
                self._held = []

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held or [], None
            if self._alive:
                for raw, tensor in held:
                    self._deliver(raw, tensor)

    def drop_next(self, n: int = 1) -> None:
        if n < 0:
            raise ValueError(f"drop_next needs n >= 0, got {n}")
        with self._lock:
            self._drop += n

    def kill(self) -> None:
        with self._lock:
            self._held = None
            self._end(self_why="cannot use a killed transport (InProcessTransport.kill)",
                      peer_why="peer was killed")

    def close(self) -> None:
        with self._lock:
            if not self._alive:
                return
            # A graceful close delivers what was in flight, as GlooTransport's does.
            held, self._held = self._held or [], None
            for raw, tensor in held:
                self._deliver(raw, tensor)
            self._end(self_why="the transport is closed", peer_why="peer closed the connection")

    def _end(self, self_why: str, peer_why: str) -> None:
        peer = self._peer
        assert peer is not None
        if self._alive:
            self._alive, self._dead_why = False, self_why
            self._inbox.end()
        if peer._alive:
            peer._alive = False
            peer._dead_why = (f"the peer is gone ({peer_why}): fail or re-route the requests "
                              "that were waiting on it")
            peer._inbox.end(lost=peer_why)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# --- gloo ---------------------------------------------------------------------------------------

def resolve_address(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise TransportError(f"cannot resolve transport host {host!r}: {exc}") from exc
    # Prefer IPv4: "localhost" may list ::1 first on hosts where the peer only speaks IPv4.
    family, _, _, _, sockaddr = min(infos, key=lambda i: i[0] != socket.AF_INET)
    addr = str(sockaddr[0])
    if ipaddress.ip_address(addr).is_unspecified:
        raise ValueError(f"host {host!r} is the wildcard address: pass the decode host's own "
                         "address (127.0.0.1 when both workers run on one machine)")
    return family, addr


def listen_fd(family: socket.AddressFamily, addr: str, port: int, where: str,
              backlog: int) -> int:
    """A listening socket on `addr` (not every interface, as TCPStore's own listener would
    bind), detached for a store to own and close (`master_listen_fd`)."""
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addr, port))
        listener.listen(backlog)
    except OSError as exc:
        listener.close()
        raise TransportError(f"rank 0 cannot listen on {where} ({exc}): pick a free port or "
                             "stop the process holding it") from exc
    return listener.detach()


def source_address(family: socket.AddressFamily, addr: str, port: int) -> str:
    """The local address this machine uses to reach `addr` (connecting UDP sends nothing)."""
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, port))
        except OSError as exc:
            raise TransportError(f"no route to the decode worker at {addr}: {exc}") from exc
        return str(s.getsockname()[0])


class GlooTransport(_Counted):
    """One end of a gloo link, world size 2. Rank 0 (the decode worker) hosts the rendezvous on
    (host, port) and rank 1 (the prefill worker) connects to it; the constructor returns once
    both are connected, or raises TransportError after `timeout` seconds. See the module
    docstring for the wire format, threads, binding and failure semantics."""

    def __init__(self, rank: int, *, host: str = "127.0.0.1", port: int = 29500,
                 timeout: float = 30.0, local_host: str | None = None,
                 max_header_bytes: int = _MAX_HEADER_BYTES,
                 max_tensor_bytes: int = _MAX_TENSOR_BYTES,
                 inbox_messages: int = INBOX_MESSAGES, store: Any = None) -> None:
        """`store`: a torch.distributed store both ends already share (a cluster's, under a
        prefix of this link's own): no rendezvous of its own, `port` is then unused.
        `max_header_bytes` / `max_tensor_bytes`: the largest header and tensor the peer may
        announce (`atom_core.pd.payload.frame_limits` of the worker's config); a larger announcement
        is a protocol error that ends the link before anything is allocated for it.
        `inbox_messages`: unread messages held before the receiver stops reading
        (backpressure)."""
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 (decode worker, hosts the rendezvous) or 1 "
                             f"(prefill worker), got {rank!r}")
        if not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be finite positive seconds, got {timeout!r}")
        for name, v in (("max_header_bytes", max_header_bytes),
                        ("max_tensor_bytes", max_tensor_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        self.max_header_bytes, self.max_tensor_bytes = max_header_bytes, max_tensor_bytes
        self.largest_alloc = 0  # bytes of the largest receive buffer allocated (tests)
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            raise TransportError("this torch build has no gloo backend: install a torch with "
                                 "torch.distributed (the CPU wheels from pytorch.org have it)")
        self.rank, self.peer_rank = rank, 1 - rank
        self.host, self.port, self.timeout = host, port, float(timeout)
        family, addr = resolve_address(host, port)
        bind = local_host or (addr if rank == 0 else source_address(family, addr, port))
        td = datetime.timedelta(seconds=timeout)
        self._store = store if store is not None else self._rendezvous(dist, family, addr, td)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
        opts._timeout = td
        opts._threads = 1  # serves collectives only; send/recv run on gloo's I/O thread
        try:
            self._pg = dist.ProcessGroupGloo(self._store, rank, 2, opts)
        except RuntimeError as exc:
            raise TransportError(f"rank {rank}: gloo could not connect to its peer within "
                                 f"{timeout:g}s via {host}:{port} ({exc}); check that both "
                                 "workers use the same host and port and that the gloo "
                                 f"address {bind} is reachable from the peer") from exc
        self._lock = threading.Lock()
        self._alive = True
        self._closing = False
        self._dead_why = ""
        self._inbox = _Inbox(inbox_messages)
        self._stats = _Stats()
        # (header bytes, tensor) to send, or None to stop the sender.
        self._outbox: queue.Queue[tuple[bytes, torch.Tensor | None] | None] = queue.Queue()
        self._pending = 0
        self._flushed = threading.Condition(self._lock)
        self._receiving = False  # a message is partly received (tests observe it)
        self.reserved_dropped = 0  # reserved kinds that came from the wire
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"gloo-transport-send-r{rank}")
        self._receiver = threading.Thread(target=self._recv_loop, daemon=True,
                                          name=f"gloo-transport-recv-r{rank}")
        self._sender.start()
        self._receiver.start()

    def _rendezvous(self, dist: Any, family: socket.AddressFamily, addr: str,
                    td: datetime.timedelta) -> Any:
        where = f"{self.host}:{self.port}"
        if self.rank == 1:
            try:
                return dist.TCPStore(addr, self.port, 2, False, timeout=td)
            except (RuntimeError, OSError) as exc:
                raise TransportError(f"rank 1 could not reach the decode worker's rendezvous "
                                     f"at {where} within {self.timeout:g}s ({exc}): start the "
                                     "decode worker (rank 0) with the same host and port") \
                    from exc
        fd = listen_fd(family, addr, self.port, where, backlog=16)
        try:
            return dist.TCPStore(addr, self.port, 2, True, timeout=td, master_listen_fd=fd)
        except (RuntimeError, OSError) as exc:
            raise TransportError(f"rank 0: no prefill worker (rank 1) connected to {where} "
                                 f"within {self.timeout:g}s ({exc}): start it with the same "
                                 "host and port, or raise the timeout") from exc

    # -- caller side --

    def _sends_pending(self) -> int:
        return self._pending

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        """Queue a message; returns at once (the sender thread ships it). Raises
        TransportError if the transport is closed or the peer is gone."""
        raw, copy = _encode_header(header), _own_copy(tensor)
        with self._lock:
            if not self._alive:
                raise TransportError(f"cannot send: {self._dead_why}")
            self._pending += 1
            self._outbox.put((raw, copy))

    def poll(self) -> list[Message]:
        return self._inbox.drain()

    def wait(self, timeout: float) -> bool:
        return self._inbox.wait(timeout)

    def flush(self, timeout: float) -> bool:
        """Wait until everything sent so far is handed to the peer; False on timeout or loss."""
        with self._flushed:
            self._flushed.wait_for(lambda: self._pending == 0 or not self._alive, timeout)
            return self._pending == 0

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            was_alive = self._alive
            if was_alive:
                self._alive, self._dead_why = False, "the transport is closed"
                self._outbox.put((_BYE_RAW, None))
            else:
                self._outbox.put(None)
            self._flushed.notify_all()
        self._inbox.discard()  # a receiver waiting for room takes the peer's bye; later
        # messages are dropped, not held: the inbox stays within `inbox_messages`
        # A send part that never completes fails after `timeout` and takes the link down, which
        # frees both threads: the margin lets that happen before giving up on them.
        deadline = time.monotonic() + self.timeout + 1.0
        self._sender.join(max(0.0, deadline - time.monotonic()))
        # The receiver leaves on the peer's answering bye, or at once if the link is down.
        self._receiver.join(max(0.0, deadline - time.monotonic()))
        self._inbox.end()
        if self._sender.is_alive() or self._receiver.is_alive():
            # A thread still inside gloo holds the group; destroying it under the thread could
            # crash, so leave both to the process's exit.
            log.warning("GlooTransport rank %d: the peer did not answer close within %gs; "
                        "abandoning the transport's threads", self.rank, self.timeout + 1.0)
            return
        # Dropping the group closes gloo's sockets and the store (rank 0: its listener).
        self._pg = None
        self._store = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- threads --

    def _lose(self, why: str) -> None:
        with self._lock:
            if self._alive:
                self._alive = False
                self._dead_why = (f"the peer is gone ({why}): fail or re-route the requests "
                                  "that were waiting on it")
            closing = self._closing
            self._pending = 0
            self._flushed.notify_all()
            self._outbox.put(None)
        # A close we started is not a loss to report.
        self._inbox.end(lost=None if closing else why)

    def _send_loop(self) -> None:
        tag = _TAG_BASE + self.rank
        wait = datetime.timedelta(seconds=self.timeout)
        while True:
            item = self._outbox.get()
            if item is None:
                return
            raw, tensor = item
            is_bye = tensor is None and raw == _BYE_RAW
            parts = [torch.tensor([len(raw), _nbytes(tensor),
                                   0 if tensor is None else _DTYPE_CODES[tensor.dtype],
                                   0 if tensor is None else tensor.dim()], dtype=torch.int64),
                     torch.frombuffer(bytearray(raw), dtype=torch.uint8)]
            if tensor is not None:
                if tensor.dim():
                    parts.append(torch.tensor(tensor.shape, dtype=torch.int64))
                if tensor.numel():
                    parts.append(tensor.reshape(-1).view(torch.uint8))
            try:
                for part in parts:
                    self._pg.send([part], self.peer_rank, tag).wait(wait)
            except Exception as exc:  # gloo raises RuntimeError subclasses; any failure ends it
                self._lose(f"sending to rank {self.peer_rank} failed: {exc}")
                return
            if is_bye:
                return
            self._stats.add("sent", len(raw) + _nbytes(tensor))
            with self._lock:
                self._pending = max(0, self._pending - 1)
                self._flushed.notify_all()

    def _alloc(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """Every receive buffer comes from here (tests assert on `largest_alloc`)."""
        t = torch.empty(n, dtype=dtype)
        self.largest_alloc = max(self.largest_alloc, t.numel() * t.element_size())
        return t

    def _recv(self, tensor: torch.Tensor) -> torch.Tensor:
        self._pg.recv([tensor], self.peer_rank, _TAG_BASE + self.peer_rank).wait(_IDLE_WAIT)
        return tensor

    def _recv_loop(self) -> None:
        try:
            while True:
                meta = self._recv(self._alloc(4, torch.int64))
                self._receiving = True
                message = self._recv_rest(*meta.tolist())
                self._receiving = False
                if message is None:
                    return
                if message[1] is not _DROP:
                    self._inbox.put(message)
        except _ProtocolError as exc:
            self._lose(f"protocol error, the peer speaks another wire format: {exc}")
        except Exception as exc:
            self._lose(f"receiving from rank {self.peer_rank} failed: {exc}")
        finally:
            self._receiving = False

    def _recv_rest(self, header_nbytes: int, tensor_nbytes: int, code: int,
                   ndim: int) -> Message | None:
        """The rest of a message after its meta; None when it was the peer's bye."""
        # Every announced size is checked against the limits before anything is allocated.
        if not 2 <= header_nbytes <= self.max_header_bytes:
            raise _ProtocolError(f"the peer announced a header of {header_nbytes} bytes, the "
                                 f"limit is {self.max_header_bytes}")
        if not 0 <= tensor_nbytes <= self.max_tensor_bytes:
            raise _ProtocolError(f"the peer announced a tensor of {tensor_nbytes} bytes, the "
                                 f"limit is {self.max_tensor_bytes} (the largest KV this "
                                 "worker's config can take)")
        if not 0 <= ndim <= _MAX_NDIM or (code != 0 and code not in _CODE_DTYPES) or \
                (code == 0 and tensor_nbytes):
            raise _ProtocolError(f"bad meta {[header_nbytes, tensor_nbytes, code, ndim]}")
        raw = self._recv(self._alloc(header_nbytes, torch.uint8))
        header = parse_header(ctypes.string_at(raw.data_ptr(), header_nbytes))
        tensor = None
        if code:
            dtype = _CODE_DTYPES[code]
            shape = self._recv(self._alloc(ndim, torch.int64)).tolist() if ndim else []
            itemsize = torch.empty((), dtype=dtype).element_size()
            if any(d < 0 for d in shape) or math.prod(shape) * itemsize != tensor_nbytes:
                raise _ProtocolError(f"{tensor_nbytes} bytes do not make a {dtype} tensor of "
                                     f"shape {shape}")
            if tensor_nbytes:
                data = self._recv(self._alloc(tensor_nbytes, torch.uint8))
                tensor = data.view(dtype).reshape(shape)
            else:
                tensor = torch.empty(shape, dtype=dtype)
        if header.get("kind") == _BYE:
            with self._lock:
                answer = not self._closing
                if answer:
                    # The peer closes first: answer so its receiver can leave its recv.
                    self._alive = False
                    self._dead_why = ("the peer is gone (peer closed the connection): fail or "
                                      "re-route the requests that were waiting on it")
                    self._outbox.put((_BYE_RAW, None))
            if answer:
                self._inbox.end(lost="peer closed the connection")
            return None
        self._stats.add("received", header_nbytes + tensor_nbytes)
        if header.get("kind") == PEER_LOST:
            # only this end reports a loss: one from the wire is dropped, never believed
            self.reserved_dropped += 1
            return header, _DROP
        return header, tensor


class _ProtocolError(Exception):
    """The byte stream is not this wire format; the link cannot be resynchronized."""


# A received message that is not handed over (see _recv_rest).
_DROP: Any = object()


def parse_header(raw: bytes) -> dict[str, Any]:
    """A received header's JSON object. Total: any bytes give a dict or `_ProtocolError`
    (invalid UTF-8, lone surrogates, deep nesting, non-objects included), never another
    exception; the strings it holds are valid text."""
    try:
        text = raw.decode("utf-8")  # strict: refuses encoded surrogates too
        header = json.loads(text)
        # "\ud800" escapes decode to lone surrogates: refuse them here, once, for every reader
        json.dumps(header, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError, TypeError) as exc:
        raise _ProtocolError(f"header is not UTF-8 JSON text: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise _ProtocolError(f"header is a {type(header).__name__}, not an object")
    return header
