"""The cluster's shared store as the processes read it: every value authenticated, parsed totally.

Threat model: a `torch.distributed` TCPStore has no access control. Any process that reaches its
port (loopback included: any local user) can read every value, set or delete any key and bump
any counter, before, during or after the cluster's own writes. So nothing a process reads from
the store is taken on trust:

- With a key, every value the cluster writes is `tag || value`, the tag an HMAC-SHA256 under a
  key derived from the cluster key for this purpose alone (`derive_key(key, STORE_PURPOSE)`),
  over the store key's full name and the value: a value written without the key, or moved to
  another key, fails and is ignored (logged once per key, `TamperLog`). Values are not secret:
  generations and gloo's addresses, which every link's key handshake then proves anyway.
- What the cluster trusts about a process is the record it wrote (`node/<rank>`: its rank and
  generation, sealed), never a raw counter: `gen/<rank>` only helps hand out numbers, and a
  rogue bump, reset or garbage there changes nothing a peer believes (`allocate_generation`).
- Each link's rendezvous (gloo's addresses) goes through a `LinkStore`: sealed on write, a
  value that fails is waited past (the real peer's write replaces it), and every wait watches
  a stop event and a deadline, so a linker that stops never leaves a thread inside gloo
  waiting for a peer that is not coming.
- Without a key (`--insecure`) nothing is authenticated, but every parse is still total: a
  malformed value is ignored (logged once) rather than raised out of a thread.

Not protected (denial of service, never a wrong link): a keyless writer can delete or overwrite
the cluster's entries. Each process writes its own record back at every scan, and a link's
rendezvous waits for the real value until its deadline (then fails, naming the key), but a
writer that keeps overwriting a record faster than that hides its process from peers. A record
sealed under the same key in an earlier run of the same cluster (same --host:--port) can be
replayed: a fresh key per run rules that out.
"""

from __future__ import annotations

import functools
import json
import logging
import struct
import threading
import time
from collections import Counter
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.hmac import HMAC

from atom_core.pd.secure_link import derive_key

__all__ = ["STORE_PURPOSE", "LinkAborted", "StoreSeal", "TamperLog", "allocate_generation",
           "link_store", "parse_record", "peek", "read_generation", "record"]

log = logging.getLogger(__name__)

STORE_PURPOSE = "cluster store mac"
_TAG_BYTES = 32
# Generations stay exact in JSON and short in link labels and wire ids.
MAX_GENERATION = 2 ** 53
# The longest value the cluster reads back from the store (records and gloo's addresses are
# far shorter): a larger one is tampering, ignored before any parse.
MAX_VALUE_BYTES = 1 << 16
# Polling a key a peer has not written yet: from every 5 ms up to every 100 ms.
_POLL_FIRST, _POLL_MAX = 0.005, 0.1


class StoreSeal:
    """Seals and opens store values under the cluster key (`key` None: insecure, values as
    they are)."""

    def __init__(self, key: bytes | None) -> None:
        self._mac_key = None if key is None else derive_key(key, STORE_PURPOSE)

    @property
    def authenticated(self) -> bool:
        return self._mac_key is not None

    def _tag(self, name: str, value: bytes) -> HMAC:
        assert self._mac_key is not None
        h = HMAC(self._mac_key, hashes.SHA256())
        # the name's length first: (name, value) splits one way only
        raw = name.encode()
        h.update(struct.pack(">I", len(raw)) + raw + value)
        return h

    def seal(self, name: str, value: bytes) -> bytes:
        if self._mac_key is None:
            return value
        return self._tag(name, value).finalize() + value

    def open(self, name: str, raw: Any) -> bytes | None:
        """The value sealed under `name`, or None when `raw` is not one (forged, moved from
        another key, altered, oversized)."""
        if not isinstance(raw, bytes) or len(raw) > MAX_VALUE_BYTES + _TAG_BYTES:
            return None
        if self._mac_key is None:
            return raw
        if len(raw) < _TAG_BYTES:
            return None
        tag, value = raw[:_TAG_BYTES], raw[_TAG_BYTES:]
        try:
            self._tag(name, value).verify(tag)  # (constant time)
        except InvalidSignature:
            return None
        return value


class TamperLog:
    """Store entries ignored, by key: the first one of each key is logged (naming the key),
    the rest only counted, so a writer that keeps tampering cannot flood the log."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.ignored: Counter[str] = Counter()
        self._lock = threading.Lock()

    def note(self, name: str, why: str, done: str = "ignored") -> None:
        with self._lock:
            self.ignored[name] += 1
            first = self.ignored[name] == 1
        if first:
            log.warning("%s: %s the cluster store's %r: %s (tampered with by a process without "
                        "the cluster key, or left over from another run); further ones of this "
                        "key are only counted", self.who, done, name[:200], why)


def record(rank: int, gen: int) -> bytes:
    """A process's record (`node/<rank>`): who it is and which start of that rank."""
    return json.dumps({"gen": gen, "rank": rank}, sort_keys=True,
                      separators=(",", ":")).encode()


def parse_record(value: bytes, rank: int) -> int | None:
    """The generation in `rank`'s record, or None when `value` is not one (total)."""
    try:
        obj = json.loads(value.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or set(obj) != {"gen", "rank"}:
        return None
    gen, r = obj["gen"], obj["rank"]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (gen, r)) or r != rank \
            or not 0 < gen < MAX_GENERATION:
        return None
    return gen


# Never a sealed value (too short) nor a counter: `peek`'s expected value.
_ABSENT = b"\0atom-core: absent\0"


def peek(store: Any, name: str) -> bytes | None:
    """`name`'s value, None when it has none, without waiting: TCPStore's `get` of a missing
    key blocks until the store's timeout, so a keyless writer deleting a key between a
    `check` and a `get` would hold the caller there. A compare-and-set expecting a value no
    writer of ours makes returns the current value and changes nothing (a missing key stays
    missing; a key holding exactly that value keeps it)."""
    raw = store.compare_set(name, _ABSENT, _ABSENT)
    return None if raw == _ABSENT else bytes(raw)


def _counter(raw: bytes) -> int:
    """A counter's value as a number, 0 when it is not one (a keyless writer's garbage)."""
    try:
        n = int(raw.decode("ascii"), 10)
    except (UnicodeDecodeError, ValueError):
        return 0
    return n if 0 <= n < MAX_GENERATION else 0


def allocate_generation(store: Any, rank: int, seal: StoreSeal, tamper: TamperLog,
                        attempts: int = 100) -> int:
    """A new generation for a process of `rank` starting now: above both the counter
    `gen/<rank>` and the last authentic record of that rank (so neither a reset counter nor a
    deleted record alone hands out a number a peer has seen). The counter is moved with
    compare-and-set, not `add`: TCPStore's `add` on a value that is not a number drops the
    caller's connection (a keyless writer's garbage would cut this process off its store)."""
    counter, name = f"gen/{rank}", f"node/{rank}"
    for _ in range(attempts):
        raw = peek(store, counter)
        if raw is None and store.check([counter]):
            raw = _ABSENT  # (a keyless writer stored exactly peek's marker)
        raw = raw or b""
        n = _counter(raw)
        if raw and str(n).encode() != raw:
            tamper.note(counter, "not a generation counter")
        prev = read_generation(store, rank, seal, tamper) or 0
        gen = max(n, prev) + 1
        if gen >= MAX_GENERATION:
            raise RuntimeError(f"the cluster store's {counter!r} or {name!r} is at the largest "
                               "generation: restart the cluster (rank 0) with a fresh store")
        new = str(gen).encode()
        if store.compare_set(counter, raw, new) == new:
            return gen
    raise RuntimeError(f"rank {rank} could not count its start in the cluster store: "
                       f"{counter!r} kept changing under it ({attempts} tries)")


def read_generation(store: Any, rank: int, seal: StoreSeal, tamper: TamperLog) -> int | None:
    """The generation `rank`'s authentic record names; None when there is none (missing, or
    ignored as tampered: logged once per key)."""
    name = f"node/{rank}"
    raw = peek(store, name)
    if raw is None:
        return None
    value = seal.open(name, raw)
    if value is None:
        tamper.note(name, "it fails authentication" if seal.authenticated else "oversized")
        return None
    gen = parse_record(value, rank)
    if gen is None:
        tamper.note(name, "not a record of this rank")
    return gen


class LinkAborted(RuntimeError):
    """The linker stopped while a link's rendezvous waited."""


def _wait_until(ready: Any, stop: threading.Event, deadline: float, what: Any) -> Any:
    """`ready()` until it gives something (returned), `stop` is set (LinkAborted) or the
    deadline passes (TimeoutError naming `what()`)."""
    pause = _POLL_FIRST
    while True:
        got = ready()
        if got is not None:
            return got
        if stop.is_set():
            raise LinkAborted("the linker stopped")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(what())
        stop.wait(min(pause, left))
        pause = min(2 * pause, _POLL_MAX)


@functools.cache
def _link_store_class() -> type:
    import torch.distributed as dist

    class _LinkStore(dist.Store):  # type: ignore[misc]
        """One link's rendezvous store for gloo: its keys under `prefix`, values sealed, reads
        authenticated and waiting past what fails; every wait ends on `stop` or the deadline
        (`timeout` seconds from now). Gloo calls set, wait and get only."""

        def __init__(self, inner: Any, prefix: str, seal: StoreSeal, tamper: TamperLog,
                     stop: threading.Event, timeout: float) -> None:
            super().__init__()
            # (not `timeout`: a property of dist.Store)
            self.inner, self.prefix, self.seal, self.tamper = inner, prefix, seal, tamper
            self.stop, self.seconds = stop, timeout
            self.deadline = time.monotonic() + timeout
            self._mine: dict[str, bytes] = {}  # what this end set: read back as set

        def set(self, key: str, value: Any) -> None:
            v = value.encode() if isinstance(value, str) else bytes(value)
            self._mine[key] = v
            name = self.prefix + key
            self.inner.set(name, self.seal.seal(name, v))

        def get(self, key: str) -> bytes:
            if key in self._mine:
                return self._mine[key]
            name = self.prefix + key
            bad: list[bytes] = []

            def authentic() -> bytes | None:
                raw = peek(self.inner, name)
                if raw is None or (bad and raw == bad[-1]):
                    return None  # (the same forged value: not opened again)
                value = self.seal.open(name, raw)
                if value is None:
                    bad.append(raw)
                    self.tamper.note(name, "it fails authentication" if self.seal.authenticated
                                     else "oversized")
                return value

            return _wait_until(authentic, self.stop, self.deadline, lambda: (
                f"the cluster store's {name!r} held only values that fail authentication "
                f"(tampered) for {self.seconds:g}s" if bad else
                f"the peer did not write the cluster store's {name!r} within "
                f"{self.seconds:g}s"))

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            names = [self.prefix + k for k in keys]
            _wait_until(lambda: True if self.inner.check(names) else None, self.stop,
                        self.deadline, lambda: f"the peer did not write the cluster store's "
                                               f"{names!r} within {self.seconds:g}s")

        def check(self, keys: list[str]) -> bool:
            return bool(self.inner.check([self.prefix + k for k in keys]))

        def _unused(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a link's rendezvous store takes set, get, wait and check only")

        add = compare_set = delete_key = num_keys = _unused

        def set_timeout(self, timeout: Any) -> None:
            pass  # (its deadline is the linker's)

    return _LinkStore


def link_store(inner: Any, prefix: str, seal: StoreSeal, tamper: TamperLog,
               stop: threading.Event, timeout: float) -> Any:
    """A `torch.distributed.Store` for one link's rendezvous (see the module docstring)."""
    return _link_store_class()(inner, prefix, seal, tamper, stop, timeout)

