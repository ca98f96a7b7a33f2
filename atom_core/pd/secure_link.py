"""An authenticated, encrypted PD link: `SecureLink` wraps a `Transport` end and is one itself.

Threat model: anyone may reach the link's port (loopback included: any local user) and read,
drop, replay or alter what travels on it. Only a holder of the shared key may take part; nothing
either worker acts on comes from anyone else, and prompts and KV are not readable on the wire.
What is not hidden: message sizes, timing and kinds (the envelope), and a peer on the path can
still drop messages or cut the link (a request then times out or fails; never a wrong token).

A link has an identity both ends know before it exists: its two roles (the decode end starts
the handshake, the prefill end answers) and its `label`, a public name the caller gives both
ends alike (e.g. the cluster's "link/<rank>.<generation>/<rank>.<generation>/", which names both
ends; "" when the caller names none). Every link of a deployment shares one key, so without the
label an attacker on the path could relay one link's handshake to another link's end (swap or
rewire two links) and both ends would accept.

Handshake, right after the rendezvous and before any message is handled (the decode worker
starts it); `binding` is the link's identity, the JSON {"initiator": "decode", "link": label,
"responder": "prefill"}:

    decode -> prefill   hello(nonce_d, link)                32 fresh random bytes; the label
    prefill -> decode   hello(nonce_p, link, proof_p)       proof_p = HMAC(k_proof, "prefill"
                                                            || 0 || nonce_d || nonce_p || binding)
    decode -> prefill   proof(proof_d)                      proof_d = HMAC(k_proof, "decode"
                                                            || 0 || nonce_d || nonce_p || binding)

(`link` is sent only when the label is not "": an unlabelled hello is as before.) Each side
first compares the label the peer offers with its own and drops a cross-wired peer with a
message naming both (labels are public names, nothing secret); the prefill side does so before
it proves anything. Each side then checks the other's proof (constant time) and drops a peer
that fails with a clear message; a peer without the key learns fresh nonces and (as a fake
decode side) one HMAC over them, nothing else. Every key is derived with HKDF-SHA256 from the
user's key (at least `payload.MIN_KEY_BYTES`; a shorter one is refused) stretched with scrypt
(`payload.stretch_key`: a proof lets anyone who reaches the port test guesses at the key
offline, and each guess then costs a scrypt), salted with both
nonces, one per purpose, the binding in the info: the proof key, one AEAD key per direction,
and the 16-byte session id. So a relay that rewrites the clear label in the hellos still fails
the proofs, and no two links, sessions or directions ever share an AEAD key. Before the
handshake completes the peer's messages are only compared with fixed shapes (bounded by the
transport's frame limits, a tensor refused): anything else fails the link with one message.

After it, every message (control messages included) travels as one ChaCha20-Poly1305 box: the
clear envelope `{"kind": "sealed", "k": kind, "rn": request nonce, "seq": n}` and a uint8
tensor holding the ciphertext of (the header's JSON, the tensor's dtype and shape, its bytes).
The associated data binds the box to the session id, the direction, the kind, the per-request
nonce (which the decode worker puts in its prefill request and the prefill worker echoes) and
the sequence number; the AEAD nonce is the sequence number under a per-direction key, so a
(key, nonce) pair is never used twice: numbers run from 0 up to MAX_SEQ - 1 and a link that
used them all fails (reconnect: a new session has new keys) rather than wrap. A box
that fails to open (altered, from another session, another direction or request) is dropped,
counted and logged (naming this end, the session and the box's request nonce); a sequence
number already seen, or older than the replay window, is dropped unopened.
A box larger than the frame limits (`pd.frame_limits`) is dropped before it is opened. The
reserved kinds (peer_lost, bye) are refused on send and dropped on receive: only the local
transport reports a loss.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import re
import struct
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from atom_core.pd.payload import MIN_KEY_BYTES, stretch_key
from atom_core.pd.transport import (
    _CODE_DTYPES,
    _DTYPE_CODES,
    PEER_LOST,
    Message,
    Transport,
    TransportError,
    _ProtocolError,
    parse_header,
)

__all__ = ["MAX_SEQ", "LinkError", "SecureLink", "box_limit", "derive_key", "establish_pair"]

log = logging.getLogger(__name__)

PROTOCOL = "atom-core/pd-link/v2"
_NONCE_BYTES = 32
_RESERVED = frozenset({PEER_LOST, "bye"})
_HANDSHAKE = frozenset({"hello", "proof"})
ROLES = ("decode", "prefill")
# A per-request nonce as the workers make it (secrets.token_hex(16)); "" for messages of no
# request.
_REQUEST_NONCE = re.compile(r"(?:[0-9a-f]{32})?\Z")
_HEX = re.compile(r"[0-9a-f]{64}\Z")
# A link's sequence numbers (the AEAD nonce's 64-bit counter) run below this; a sender that
# reaches it fails the link instead of sending boxes the peer would refuse (or wrapping).
MAX_SEQ = 2 ** 63
# The longest link label (a public name: printable text).
MAX_LABEL_CHARS = 256
# Sequence numbers within this distance of the highest seen are remembered (the transports
# deliver in order, so a window this size only ever holds what a reordering could need).
REPLAY_WINDOW = 1024
# The largest plaintext one box holds (the AEAD's limit per call, 2**31 - 1 bytes).
MAX_BOX_PLAINTEXT = 2 ** 31 - 1
# Dropped boxes logged per reason: the first LOG_FIRST, then every LOG_EVERY-th.
LOG_FIRST = 10
LOG_EVERY = 1000
# Messages sent before the handshake completes wait, at most this many.
MAX_QUEUED = 4096
# Envelope and inner-header bytes beyond the frame limits' header and tensor.
_BOX_OVERHEAD = 4 + 16 + 512
_NAMES = {str(d).removeprefix("torch."): d for d in _DTYPE_CODES}


class LinkError(TransportError):
    """The handshake failed: the peer does not hold the key, speaks another protocol, or did
    not answer in time. The link is closed; nothing was handled."""


def _check_key(key: Any) -> None:
    """Refuse what is not a usable PD key. Says only the length: never the key."""
    if not isinstance(key, bytes):
        raise ValueError(f"the PD key must be bytes (pd.load_key), got {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        # an empty or short key makes every derived key public or guessable
        raise ValueError(f"the PD key is {len(key)} bytes; it must be at least {MIN_KEY_BYTES} "
                         "(pd.load_key; e.g. `python -c 'import secrets; "
                         "print(secrets.token_hex(32))'`)")


def derive_key(key: bytes, purpose: str, salt: bytes | None = None, length: int = 32,
               context: bytes = b"") -> bytes:
    """A key for one `purpose` from the user's key (HKDF-SHA256); `context` (a link's binding)
    goes into the info after a NUL, which no purpose holds. ValueError for a key shorter than
    `payload.MIN_KEY_BYTES`: HKDF takes an empty key and would hand out a public one."""
    _check_key(key)
    info = f"{PROTOCOL} {purpose}".encode() + (b"\0" + context if context else b"")
    # from the stretched secret: a guess at it costs a scrypt, not one HMAC (payload.py)
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(
        stretch_key(key))


def _binding(label: str) -> bytes:
    """The link's identity as the handshake binds it (canonical JSON: unambiguous)."""
    return json.dumps({"initiator": "decode", "link": label, "responder": "prefill"},
                      sort_keys=True, separators=(",", ":")).encode()


def _proof(k_proof: bytes, role: str, nonce_d: bytes, nonce_p: bytes, binding: bytes) -> bytes:
    # role and nonces have fixed lengths before the binding: the message parses one way only
    return hmac.new(k_proof, role.encode() + b"\0" + nonce_d + nonce_p + binding,
                    "sha256").digest()


def label_ok(label: Any) -> bool:
    """A usable link label: printable text of at most MAX_LABEL_CHARS."""
    return isinstance(label, str) and len(label) <= MAX_LABEL_CHARS and label.isprintable()


def _describe(v: Any) -> str:
    """An unauthenticated value for a message: a short str's repr, else only its type (the
    repr of a deeply nested list would recurse past the interpreter's limit)."""
    return repr(v[:32]) if isinstance(v, str) else f"a JSON {type(v).__name__}"


def _hex_bytes(v: Any, pattern: re.Pattern[str] = _HEX) -> bytes | None:
    return bytes.fromhex(v) if isinstance(v, str) and pattern.match(v) else None


class SecureLink:
    """One end of an authenticated, encrypted link over `inner` (see the module docstring).

    `role`: "decode" (starts the handshake) or "prefill". `label`: the link's public name,
    the same on both ends (printable, at most MAX_LABEL_CHARS): a peer offering another one
    fails the handshake. The handshake runs inside `poll`
    (single-threaded drivers) or `establish(timeout)` (blocks until done or raises LinkError);
    messages sent before it completes wait, in order, and are sealed once it does.
    `max_box_bytes`: the largest box accepted (`pd.frame_limits`: header + tensor bytes; see
    `box_limit`); None: the transport's own limit. `handshake_timeout`: seconds (on `clock`)
    after which an unfinished handshake fails the link. Stats: `dropped` (Counter by reason:
    auth, replay, malformed, oversized, reserved, unsealed), `auth_failures`."""

    secure = True  # workers use a transport that says so as is

    def __init__(self, inner: Transport, key: bytes, role: str, *, label: str = "",
                 max_box_bytes: int | None = None, handshake_timeout: float = 30.0,
                 replay_window: int = REPLAY_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        _check_key(key)
        if not label_ok(label):
            raise ValueError(f"label must be printable text of at most {MAX_LABEL_CHARS} "
                             f"characters (the link's public name), got {label!r:.80}")
        if not (math.isfinite(handshake_timeout) and handshake_timeout > 0):
            raise ValueError(f"handshake_timeout must be finite positive seconds, got "
                             f"{handshake_timeout!r}")
        if isinstance(replay_window, bool) or not isinstance(replay_window, int) \
                or replay_window < 0:
            # a negative window would refuse every box in order: the link would drop all
            raise ValueError(f"replay_window must be an integer >= 0, got {replay_window!r}")
        self.inner, self.role, self.label = inner, role, label
        self._key = key
        self._binding = _binding(label)
        self.max_box_bytes = max_box_bytes
        self._clock, self._deadline = clock, clock() + handshake_timeout
        self._window = replay_window
        self._nonce = os.urandom(_NONCE_BYTES)
        self._peer_nonce: bytes | None = None
        self.established = False
        self.failed: str | None = None
        self.session_id: bytes | None = None
        self._send_key: ChaCha20Poly1305 | None = None
        self._recv_key: ChaCha20Poly1305 | None = None
        self._send_seq = 0
        self._recv_max = -1
        self._recv_seen: set[int] = set()
        self._queued: list[tuple[dict[str, Any], torch.Tensor | None]] = []
        self._early: list[Message] = []  # what arrived in the same poll as the last proof
        self.dropped: Counter[str] = Counter()
        if role == "decode":
            self._raw_send(self._hello())

    # ------------------------------------------------------------------ Transport
    @property
    def alive(self) -> bool:
        return self.failed is None and self.inner.alive

    @property
    def stats(self) -> dict[str, int]:
        return {**self.inner.stats, "auth_failures": self.dropped["auth"],
                "dropped": sum(self.dropped.values())}

    @property
    def auth_failures(self) -> int:
        return self.dropped["auth"]

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        if not isinstance(header, dict):
            raise TypeError(f"a message header must be a dict, got {type(header).__name__}")
        kind = header.get("kind")
        if not isinstance(kind, str) or kind in _RESERVED | _HANDSHAKE | {"sealed"}:
            raise ValueError(f"header kind {kind!r} is reserved for the link and transport: "
                             "use another kind")
        if self.failed is not None:
            raise TransportError(f"cannot send: {self.failed}")
        if not self.established:
            if len(self._queued) >= MAX_QUEUED:
                raise TransportError(f"{MAX_QUEUED} messages already wait for the key "
                                     "handshake: the peer does not answer it")
            self._queued.append((dict(header), None if tensor is None else tensor.clone()))
            return
        self._seal_and_send(header, tensor)

    def poll(self) -> list[Message]:
        out, self._early = self._early, []
        for header, tensor in self.inner.poll():
            if header.get("kind") == PEER_LOST:  # the local transport's own report
                if not self.established and self.failed is None:
                    self.failed = f"the peer left during the handshake: {header.get('error')}"
                out.append((header, tensor))
            elif self.failed is not None:
                continue
            elif not self.established:
                self._handshake(header, tensor)
            else:
                opened = self._open(header, tensor)
                if opened is not None:
                    out.append(opened)
        if not self.established and self.failed is None and self._clock() > self._deadline:
            self._fail("the peer did not complete the key handshake in time: it does not speak "
                       "this protocol or is not a PD worker")
        if self.failed is not None and not any(h.get("kind") == PEER_LOST for h, _ in out) \
                and not self._reported:
            self._reported = True
            out.append(({"kind": PEER_LOST, "error": self.failed}, None))
        return out

    _reported = False

    def wait(self, timeout: float) -> bool:
        return bool(self._early) or self.inner.wait(timeout)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:  # flush, largest_alloc, ... of the transport
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def establish(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Run the handshake until it completes; LinkError if it fails, `timeout` passes or
        `stop` is set (a caller shutting down must not leave a thread waiting on a peer).
        What arrives meanwhile after the handshake is kept for the next `poll`."""
        deadline = time.monotonic() + timeout
        while not self.established:
            if self.failed is not None:
                raise LinkError(self.failed)
            if stop is not None and stop.is_set():
                self._fail("the key handshake was given up: this process is stopping")
                raise LinkError(self.failed or "")
            if time.monotonic() > deadline:
                self._fail(f"no key handshake within {timeout:g}s: the peer is not a PD worker "
                           "of this version")
                raise LinkError(self.failed or "")
            self.inner.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            got = self.poll()  # (poll replaces _early: read it after)
            self._early.extend(got)
        if self.failed is not None:
            raise LinkError(self.failed)

    # ------------------------------------------------------------------ handshake
    def _raw_send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        try:
            self.inner.send(header, tensor)
        except TransportError as exc:
            self._fail(f"the link broke during the key handshake: {exc}")

    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            self._queued.clear()  # never sent: the peer was not authenticated
            log.warning("PD link (%s side): %s", self.role, why)
            try:
                self.inner.close()
            except Exception:  # noqa: BLE001 - closing a broken link is best effort
                pass

    def _hello(self, **more: str) -> dict[str, Any]:
        h = {"kind": "hello", "v": PROTOCOL, "role": self.role, "nonce": self._nonce.hex()}
        if self.label:  # (an unlabelled hello keeps its fields as before labels existed)
            h["link"] = self.label
        return {**h, **more}

    def _derive(self, purpose: str, length: int = 32) -> bytes:
        """A key of this session: salted with both nonces, bound to the link's identity."""
        nd, np_ = self._nonces()
        return derive_key(self._key, purpose, nd + np_, length, self._binding)

    def _handshake(self, h: dict[str, Any], tensor: torch.Tensor | None) -> None:
        # Nothing here is authenticated yet: every field is compared with a fixed shape, and
        # messages name what came only through `_describe` (bounded, never recursive).
        kind, want = h.get("kind"), ("hello" if self.role == "decode" or
                                     self._peer_nonce is None else "proof")
        if kind != want or h.get("v", PROTOCOL) != PROTOCOL:
            self._fail(f"the peer sent {_describe(kind)} where the key handshake expects "
                       f"{want!r}: it is not a PD worker of this version, or has no key "
                       "(start both workers with the same --key)")
            return
        if tensor is not None:
            self._fail(f"the peer's {kind!r} carries a tensor: the key handshake has none; "
                       "dropped")
            return
        if kind == "hello":
            nonce = _hex_bytes(h.get("nonce"))
            peer_role = "prefill" if self.role == "decode" else "decode"
            offered = h.get("link", "")
            if nonce is None or h.get("role") != peer_role or nonce == self._nonce \
                    or not label_ok(offered):
                self._fail("the peer's hello is malformed (nonce, role or link label): dropped")
                return
            if offered != self.label:
                # before any proof: a misrouted peer learns nothing of this key
                self._fail(f"cross-wired link: this {self.role} end belongs to link "
                           f"{self.label!r}, but the {peer_role} end it reached offered link "
                           f"{offered!r}; dropped (an attacker on the path relays another "
                           "link, or the two ends were given different labels)")
                return
            self._peer_nonce = nonce
            nd, np_ = self._nonces()
            k_proof = self._derive("handshake proof")
            if self.role == "prefill":
                self._raw_send(self._hello(
                    proof=_proof(k_proof, "prefill", nd, np_, self._binding).hex()))
                return
            if not self._check_proof(h.get("proof"), k_proof, "prefill"):
                return
            self._raw_send({"kind": "proof",
                            "proof": _proof(k_proof, "decode", nd, np_, self._binding).hex()})
            self._ready()
        elif self._check_proof(h.get("proof"), self._derive("handshake proof"), "decode"):
            self._ready()

    def _nonces(self) -> tuple[bytes, bytes]:
        assert self._peer_nonce is not None
        return (self._nonce, self._peer_nonce) if self.role == "decode" else \
            (self._peer_nonce, self._nonce)

    def _check_proof(self, got: Any, k_proof: bytes, peer_role: str) -> bool:
        nd, np_ = self._nonces()
        want = _proof(k_proof, peer_role, nd, np_, self._binding)
        got_b = _hex_bytes(got)
        if got_b is None or not hmac.compare_digest(got_b, want):
            self._fail(f"the {peer_role} worker failed the key challenge: it does not hold "
                       "this key (or is not who it claims to be: the handshake binds the link "
                       f"{self.label!r}, and a relay from another link fails here), or runs "
                       "another atom-core version; dropped. Give both workers the same --key")
            return False
        return True

    def _ready(self) -> None:
        self.session_id = self._derive("session id", 16)
        # one key per direction: the two ends' sequence numbers never share a key
        d2p = ChaCha20Poly1305(self._derive("aead decode->prefill"))
        p2d = ChaCha20Poly1305(self._derive("aead prefill->decode"))
        self._send_key, self._recv_key = (d2p, p2d) if self.role == "decode" else (p2d, d2p)
        self.established = True
        queued, self._queued = self._queued, []
        for header, tensor in queued:
            self._seal_and_send(header, tensor)

    # ------------------------------------------------------------------ boxes
    def _ad(self, direction: str, kind: str, rn: str, seq: int) -> bytes:
        assert self.session_id is not None
        return json.dumps([PROTOCOL, self.session_id.hex(), direction, kind, rn, seq],
                          separators=(",", ":")).encode()

    def _seal_and_send(self, header: dict[str, Any], tensor: torch.Tensor | None) -> None:
        assert self._send_key is not None
        kind = header["kind"]
        rn = header.get("nonce", "")
        if not isinstance(rn, str) or not _REQUEST_NONCE.match(rn):
            raise ValueError("a header's nonce must be 32 lowercase hex digits "
                             "(secrets.token_hex(16)) or absent")
        meta: list[Any] | None = None
        data: Any = b""
        if tensor is not None:
            if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _DTYPE_CODES:
                raise TypeError("a message tensor must be a torch.Tensor of a supported dtype")
            t = tensor.detach().cpu().contiguous()
            meta = [str(t.dtype).removeprefix("torch."), [int(d) for d in t.shape]]
            data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        try:
            inner = json.dumps({"h": header, "t": meta}, separators=(",", ":"),
                               ensure_ascii=False).encode()
        except (TypeError, ValueError) as exc:
            raise TypeError(f"a message header must be JSON-serializable text ({exc})") from exc
        size = 4 + len(inner) + (len(data) if isinstance(data, bytes) else data.nbytes)
        if size > MAX_BOX_PLAINTEXT:
            # the AEAD takes at most 2**31 - 1 bytes per call; chunked boxes are not done yet
            raise ValueError(f"a message of {size} bytes does not fit one sealed box (at most "
                             f"{MAX_BOX_PLAINTEXT}): ship KV of fewer positions per message")
        seq = self._send_seq
        if seq >= MAX_SEQ:
            # the peer refuses this number (and the nonce's 8-byte counter ends at 2**64, where
            # only a wrap, reusing a nonce under this key, could go on): end the session
            # instead; a new one has new keys
            self._fail(f"this link sent {MAX_SEQ} boxes, every sequence number its keys allow: "
                       "reconnect (a new session has new keys)")
            raise TransportError(f"cannot send: {self.failed}")
        self._send_seq += 1
        plain = b"".join([struct.pack(">I", len(inner)), inner, data])
        box = self._send_key.encrypt(struct.pack(">4xQ", seq), plain,
                                     self._ad(self.role, kind, rn, seq))
        with warnings.catch_warnings():  # the transport copies it; nothing writes it here
            warnings.simplefilter("ignore", UserWarning)
            wire = torch.frombuffer(box, dtype=torch.uint8)
        self.inner.send({"kind": "sealed", "k": kind, "rn": rn, "seq": seq}, wire)

    def _open(self, env: dict[str, Any], box: Any) -> Message | None:
        """The message in a received box, or None (dropped and counted)."""
        if env.get("kind") != "sealed":
            self.dropped["unsealed"] += 1  # a handshake message again, or a plain message
            return None
        kind, rn, seq = env.get("k"), env.get("rn"), env.get("seq")
        if set(env) != {"kind", "k", "rn", "seq"} or not isinstance(kind, str) \
                or len(kind) > 64 or not isinstance(rn, str) or not _REQUEST_NONCE.match(rn) \
                or isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < MAX_SEQ \
                or not isinstance(box, torch.Tensor) or box.dtype != torch.uint8 \
                or box.dim() != 1:
            self.dropped["malformed"] += 1
            return None
        if kind in _RESERVED:
            self._drop("reserved", kind, rn, seq)
            return None
        if self.max_box_bytes is not None and box.numel() > self.max_box_bytes:
            self._drop("oversized", kind, rn, seq, f"{box.numel()} bytes, the limit is "
                                                   f"{self.max_box_bytes}")
            return None
        if seq in self._recv_seen or seq <= self._recv_max - self._window:
            self._drop("replay", kind, rn, seq)
            return None
        assert self._recv_key is not None
        peer = "prefill" if self.role == "decode" else "decode"
        try:
            # the tensor's memory as is (the AEAD reads any buffer): no copy before the tag check
            plain = self._recv_key.decrypt(struct.pack(">4xQ", seq), box.contiguous().numpy(),
                                           self._ad(peer, kind, rn, seq))
        except InvalidTag:
            self._drop("auth", kind, rn, seq, "it fails authentication: altered, truncated, "
                                              "extended, or sealed for another session, "
                                              "direction or request")
            return None
        # only an authentic box moves the window: forged numbers cannot burn real ones
        self._recv_seen.add(seq)
        if seq > self._recv_max:
            self._recv_max = seq
            if len(self._recv_seen) > 2 * self._window:
                self._recv_seen = {s for s in self._recv_seen if s > seq - self._window}
        try:
            return self._unpack(plain, kind, rn)
        except (_ProtocolError, ValueError, TypeError, KeyError, struct.error, RuntimeError):
            self._drop("malformed", kind, rn, seq, "authentic but malformed inside: the peer "
                                                   "is broken")
            return None

    def _drop(self, reason: str, kind: str, rn: str, seq: int, why: str = "") -> None:
        """Count a dropped box and say so in the log, naming this link's end and the box's
        request nonce (from its envelope, which is not authenticated: a hint for the operator,
        never acted on). The request it belonged to, if any, then ends by its transfer
        timeout. The first few per reason are logged, then every LOG_EVERY-th: a peer that
        floods bad boxes cannot flood the log."""
        self.dropped[reason] += 1
        n = self.dropped[reason]
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            log.warning("PD link (%s side, session %s): dropped a %r box (%s; seq %d, request "
                        "nonce %s): %s%s (%d dropped for this reason so far)", self.role,
                        self.session_id.hex()[:8] if self.session_id else "-", kind[:64],
                        reason, seq, rn[:8] or "-", why or reason,
                        "" if n < LOG_FIRST else "; further ones are logged sparsely", n)

    @staticmethod
    def _unpack(plain: bytes, kind: str, rn: str) -> Message:
        (n,) = struct.unpack_from(">I", plain)
        if n > len(plain) - 4:
            raise ValueError("inner header overruns the box")
        inner = parse_header(plain[4:4 + n])
        header, meta = inner.get("h"), inner.get("t")
        if not isinstance(header, dict) or header.get("kind") != kind or \
                header.get("nonce", "") != rn:
            raise ValueError("the box's header disagrees with its envelope")
        data = memoryview(plain)[4 + n:]
        if meta is None:
            if len(data):
                raise ValueError("bytes after a message without a tensor")
            return header, None
        name, shape = meta
        dtype = _NAMES[name]
        if dtype not in _CODE_DTYPES.values() or not isinstance(shape, list) or \
                len(shape) > 8 or not all(isinstance(d, int) and not isinstance(d, bool)
                                          and d >= 0 for d in shape):
            raise ValueError("bad tensor meta")
        item = torch.empty((), dtype=dtype).element_size()
        if math.prod(shape) * item != len(data):
            raise ValueError("tensor bytes disagree with its shape")
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else \
            torch.empty(0, dtype=torch.uint8)
        return header, t.view(dtype).reshape(shape)


def box_limit(header_bytes: int, tensor_bytes: int) -> int:
    """The largest box a message within these frame limits makes (`pd.frame_limits`)."""
    return header_bytes + tensor_bytes + _BOX_OVERHEAD


def establish_pair(a: SecureLink, b: SecureLink, rounds: int = 8) -> None:
    """Run both ends' handshake in one thread (in-process pairs); LinkError if it fails."""
    for _ in range(rounds):
        for end in (a, b):
            got = end.poll()  # (poll replaces _early: read it after)
            end._early.extend(got)
            if end.failed is not None:
                raise LinkError(end.failed)
        if a.established and b.established:
            return
    raise LinkError(a.failed or b.failed or "the key handshake did not complete")
