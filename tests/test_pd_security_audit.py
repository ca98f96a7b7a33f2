"""Findings of a security review of the PD links (`atom_core.pd.secure_link`, `atom_core.pd.links`),
each pinned by a test that failed before its fix:

- the handshake bound nothing of the link's identity: every link of a deployment shares one key,
  so an attacker on the path could relay one link's handshake to another link's end (swap or
  rewire two links) and both ends accepted; now the link's label and roles are offered in the
  hellos, compared first (a clear message naming both), and bound into every derived key and
  both proofs (a relay that rewrites the clear label still fails);
- a peer could crash the link before the handshake: a hello whose kind was a deeply nested list
  (valid JSON within the frame limits) made the error message's str() recurse past the
  interpreter's limit, and RecursionError left `poll`; a handshake message could also carry a
  tensor, which was ignored;
- `derive_key` took an empty or short key (HKDF accepts one) and handed out public keys (the
  payload MAC key of b"" is anyone's to compute);
- a sender past 2**63 boxes kept sending boxes the peer drops as malformed (and would hit a
  struct error at 2**64) instead of ending the session;
- a negative replay window was taken, and made the link drop every box;
- a secure link set (`DecodeLinks`/`PrefillLinks` with a key) took a plain link, and the worker,
  trusting the set's `secure`, wrapped nothing: prompts and KV in clear without the insecure
  flag;
- a departing decode worker's "shutdown" with a deeply nested "error" crashed its prefill
  worker's `DecodeLinks.poll` the same way (insecure mode: anyone; with a key: an authenticated
  but broken peer).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_pd_link import KEY, N0, OTHER_KEY, Tap, pair

from atom_core.pd import workers
from atom_core.pd.links import DecodeLinks, PrefillLinks
from atom_core.pd.secure_link import (
    PROTOCOL,
    LinkError,
    SecureLink,
    derive_key,
    establish_pair,
)
from atom_core.pd.transport import PEER_LOST, InProcessTransport, TransportError, parse_header

LINK_A, LINK_B = "link/3.1/1.1/", "link/4.1/1.1/"  # as the cluster names links: ranks, generations


def _links(label_d: str, label_p: str, dkey: bytes = KEY, pkey: bytes = KEY
           ) -> tuple[SecureLink, SecureLink, Tap, Tap]:
    td, tp = InProcessTransport.pair()
    wd, wp = Tap(td), Tap(tp)
    return (SecureLink(wd, dkey, "decode", label=label_d),  # type: ignore[arg-type]
            SecureLink(wp, pkey, "prefill", label=label_p), wd, wp)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- link identity
class Relabel:
    """An attacker's wire: hands each end a hello that claims the end's own label, so the clear
    comparison passes; only the handshake's binding can tell."""

    def __init__(self, inner: InProcessTransport, mine: str) -> None:
        self.inner, self.mine = inner, mine

    def poll(self) -> list[tuple[dict[str, Any], torch.Tensor | None]]:
        return [({**h, "link": self.mine} if h.get("kind") == "hello" else h, t)
                for h, t in self.inner.poll()]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_relay_between_two_links_fails_the_handshake_naming_both_links() -> None:
    # The decode end of link A and the prefill end of link B, joined by an attacker on the path:
    # both hold the deployment's one key, so before the fix the handshake succeeded and the
    # decode worker's requests (prompts) reached a prefill worker it never meant to ask.
    d, p, wd, wp = _links(LINK_A, LINK_B)
    d.send({"kind": "prefill", "id": "0", "nonce": N0, "prompt": [1, 2, 3]})  # queued
    with pytest.raises(LinkError, match="cross-wired") as err:
        establish_pair(d, p)
    msg = str(err.value)
    assert repr(LINK_A) in msg and repr(LINK_B) in msg  # what each end expected and was offered
    assert not d.established and not p.established
    # the prefill end refused before proving anything; the request never left the decode end
    assert [h["kind"] for h, _ in wp.sent] == [] and [h["kind"] for h, _ in wd.sent] == ["hello"]
    assert wd.sent[0][0]["link"] == LINK_A
    assert d.poll()[-1][0]["kind"] == PEER_LOST
    # a relay that shows the prefill end its own label: the decode end compares too
    td, tp = InProcessTransport.pair()
    d = SecureLink(td, KEY, "decode", label=LINK_A)
    p = SecureLink(Relabel(tp, LINK_B), KEY, "prefill", label=LINK_B)  # type: ignore[arg-type]
    with pytest.raises(LinkError, match=f"this decode end belongs to link {LINK_A!r}, but the "
                                        f"prefill end it reached offered link {LINK_B!r}"):
        establish_pair(d, p)
    # an unlabelled end against a labelled one is a mismatch, not a match
    d, p, _, _ = _links(LINK_A, "")
    with pytest.raises(LinkError, match=f"belongs to link '', but .* offered link {LINK_A!r}"):
        establish_pair(d, p)
    # the same label on both ends: the link works, and a box goes through
    d, p, _, _ = _links(LINK_A, LINK_A)
    establish_pair(d, p)
    d.send({"kind": "prefill", "id": "0", "nonce": N0, "prompt": [7]})
    assert [h["prompt"] for h, _ in p.poll()] == [[7]]


def test_a_relay_that_rewrites_the_labels_still_fails_the_proofs() -> None:
    # The labels travel in clear: the binding in the keys and proofs is what stops a relay.
    td, tp = InProcessTransport.pair()
    d = SecureLink(Relabel(td, LINK_A), KEY, "decode", label=LINK_A)  # type: ignore[arg-type]
    p = SecureLink(Relabel(tp, LINK_B), KEY, "prefill", label=LINK_B)  # type: ignore[arg-type]
    with pytest.raises(LinkError, match="failed the key challenge") as err:
        establish_pair(d, p)
    assert repr(LINK_A) in str(err.value)  # names the link this end binds
    assert d.session_id is None and p.session_id is None
    # control: the same relay between two ends of one link changes nothing and works
    td, tp = InProcessTransport.pair()
    d = SecureLink(Relabel(td, LINK_A), KEY, "decode", label=LINK_A)  # type: ignore[arg-type]
    p = SecureLink(Relabel(tp, LINK_A), KEY, "prefill", label=LINK_A)  # type: ignore[arg-type]
    establish_pair(d, p)
    assert d.session_id == p.session_id


def test_the_link_label_is_checked_and_never_leaks_the_key(
        caplog: pytest.LogCaptureFixture) -> None:
    td, _ = InProcessTransport.pair()
    for bad in ("x" * 257, "a\nb", 7):  # (a newline would forge lines in the log)
        with pytest.raises(ValueError, match="label must be printable"):
            SecureLink(td, KEY, "decode", label=bad)  # type: ignore[arg-type]
    # a failed handshake's message and log name labels and roles, never the key
    d, p, _, _ = _links(LINK_A, LINK_A, pkey=OTHER_KEY)
    with caplog.at_level(logging.WARNING, logger="atom_core.pd.secure_link"), \
            pytest.raises(LinkError) as err:
        establish_pair(d, p)
    said = str(err.value) + caplog.text
    assert repr(LINK_A) in said
    for k in (KEY, OTHER_KEY):
        assert k.decode() not in said and k.hex() not in said


# --------------------------------------------------------------------------- before the handshake
def _deepest_list() -> Any:
    """A JSON list nested nearly as deep as the transports' parser accepts from this stack."""
    lo, hi = 1, 5000
    while lo < hi:  # (parse_header is what the gloo receiver runs on every header)
        mid = (lo + hi + 1) // 2
        try:
            parse_header(b'{"k":' + b"[" * mid + b"]" * mid + b"}")
            lo = mid
        except Exception:  # noqa: BLE001 - too deep: _ProtocolError
            hi = mid - 1
    return parse_header(b'{"k":' + b"[" * (lo - 30) + b"]" * (lo - 30) + b"}")["k"]


def _from_deeper(frames: int, f: Callable[[], Any]) -> Any:
    """`f()` called `frames` frames further down, as a worker's loop calls `poll`."""
    return f() if frames == 0 else _from_deeper(frames - 1, f)


class Received:
    """An end whose next poll hands over `got` first: what the gloo receiver makes of any
    bytes `parse_header` takes (an in-process send refuses a kind that is not text)."""

    def __init__(self, inner: InProcessTransport,
                 got: list[tuple[dict[str, Any], torch.Tensor | None]]) -> None:
        self.inner, self.got = inner, got

    def poll(self) -> list[tuple[dict[str, Any], torch.Tensor | None]]:
        got, self.got = self.got, []
        return got + self.inner.poll()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("how", ["deep kind", "tensor", "deep label", "long label"])
def test_a_malformed_message_before_the_handshake_is_one_clear_error(how: str) -> None:
    td, tp = InProcessTransport.pair()
    hello: dict[str, Any] = {"kind": "hello", "v": PROTOCOL, "role": "decode",
                             "nonce": "ab" * 32, "link": LINK_A}
    tensor = None
    if how == "deep kind":
        hello["kind"] = _deepest_list()
    elif how == "tensor":
        tensor = torch.zeros(1000, dtype=torch.uint8)
    elif how == "deep label":
        hello["link"] = _deepest_list()
    else:
        hello["link"] = LINK_A + "x" * 300
    # from a peer that holds no key: nothing of it is authenticated
    p = SecureLink(Received(tp, [(hello, tensor)]), KEY, "prefill",  # type: ignore[arg-type]
                   label=LINK_A)
    got = _from_deeper(150, p.poll)  # never raises (before the fix: RecursionError)
    assert got[-1][0]["kind"] == PEER_LOST and p.failed is not None
    assert not p.established and p.session_id is None
    assert len(p.failed) < 400  # one bounded message, whatever the peer sent
    assert td.poll()[-1][0]["kind"] == PEER_LOST  # the link is down; the peer got no proof


# --------------------------------------------------------------------------- keys
def test_an_empty_or_short_key_is_refused_with_a_clear_error() -> None:
    for short in (b"", b"k", b"k" * 15):
        # before the fix HKDF took these: derive_key(b"", "payload mac") is public knowledge
        with pytest.raises(ValueError, match=f"is {len(short)} bytes; it must be at least 16"):
            derive_key(short, "payload mac")
        with pytest.raises(ValueError, match="at least 16"):
            SecureLink(InProcessTransport.pair()[0], short, "decode")
    with pytest.raises(ValueError, match="must be bytes"):
        SecureLink(InProcessTransport.pair()[0], bytearray(KEY), "decode")  # type: ignore
    with pytest.raises(ValueError) as err:
        derive_key(b"tiny-secret", "payload mac")
    assert "tiny-secret" not in str(err.value)  # the message gives the length, not the key
    assert len(derive_key(b"k" * 16, "payload mac")) == 32  # the minimum itself is taken


# --------------------------------------------------------------------------- sequence numbers
def test_a_link_that_used_every_sequence_number_ends_instead_of_wrapping() -> None:
    d, p, wd, _ = pair()
    establish_pair(d, p)
    last = 2 ** 63 - 1  # the highest number the receiver takes (a 64-bit nonce counter)
    d._send_seq = last  # (a link that has sent this many boxes)
    d.send({"kind": "prefill", "id": "0", "nonce": N0, "prompt": [1]})
    assert [h["id"] for h, _ in p.poll()] == ["0"] and wd.sent[-1][0]["seq"] == last
    sent = len(wd.sent)
    # before the fix this box went out (seq 2**63: dropped by the peer as malformed, so its
    # request waited for a timeout; at 2**64 a struct error)
    with pytest.raises(TransportError, match="every sequence number"):
        d.send({"kind": "prefill", "id": "1", "nonce": N0, "prompt": [1]})
    assert len(wd.sent) == sent and not d.alive
    assert d.poll()[-1][0]["kind"] == PEER_LOST  # the worker sees the loss and re-routes
    assert p.poll()[-1][0]["kind"] == PEER_LOST and p.dropped == {}


def test_a_negative_replay_window_is_refused() -> None:
    with pytest.raises(ValueError, match="replay_window"):
        pair(replay_window=-1)
    with pytest.raises(ValueError, match="replay_window"):
        pair(replay_window=1.5)
    d, p, _, wp = pair(replay_window=0)  # 0 is the strictest: in order only
    establish_pair(d, p)
    p.send({"kind": "x"})
    p.send({"kind": "y"})
    assert [h["kind"] for h, _ in d.poll()] == ["x", "y"]
    wp.inner.send(*wp.sent[-2])  # an older box: refused unopened
    assert d.poll() == [] and d.dropped == {"replay": 1}


# --------------------------------------------------------------------------- link sets
@pytest.mark.parametrize("links_type", [DecodeLinks, PrefillLinks])
def test_a_secure_link_set_takes_no_plain_link(links_type: type) -> None:
    links = links_type(secure=True)
    plain, _ = InProcessTransport.pair()
    with pytest.raises(ValueError, match="plain InProcessTransport in a secure link set"):
        links.add(0, plain)
    assert links.links == {}
    # why it matters: the worker trusts the set's `secure` and wraps nothing around it
    assert workers._secure(links, KEY, "prefill", None, None, None, True)[0] is links  # type: ignore
    d, p, _, _ = pair()
    establish_pair(d, p)
    links.add(0, d if links_type is PrefillLinks else p)  # a SecureLink is taken
    assert list(links.links) == [0]
    links_type(secure=False).add(0, plain)  # the insecure mode (asked for) takes plain links


def test_a_departing_peer_with_a_deeply_nested_reason_does_not_crash_poll() -> None:
    links = DecodeLinks(secure=False)
    mine, theirs = InProcessTransport.pair()
    links.add(3, mine)
    theirs.send({"kind": "prefill", "id": "a", "nonce": N0, "prompt": [1]})
    assert [h["kind"] for h, _ in links.poll()] == ["prefill"]
    theirs.send({"kind": "shutdown", "error": _deepest_list()})
    got = _from_deeper(150, links.poll)  # before the fix: RecursionError
    assert [(h["kind"], h["id"]) for h, _ in got] == [("cancel", "a")]  # its request ends
    assert "it shut down" in links.lost[3] and len(links.lost[3]) < 200
    long, theirs2 = InProcessTransport.pair()
    links.add(4, long)
    theirs2.send({"kind": "shutdown", "error": "e" * 100_000})
    links.poll()
    assert links.lost[4] == "e" * 500  # a long reason is cut, not kept whole


def test_cluster_links_are_labelled_with_both_ends() -> None:
    """The cluster's linker gives each secure link its name (both ranks and generations), the
    same at both ends: the binding above only protects links that carry a label."""
    from atom_core.pd.cluster_run import Layout, Linker, open_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layout = Layout(prefill=1, decode=0)
    limits = lambda _peer: {"max_header_bytes": 1 << 16, "max_tensor_bytes": 1 << 20}  # noqa: E731
    store0 = open_store("127.0.0.1", port, 0, 20.0)
    store1 = open_store("127.0.0.1", port, 1, 20.0)
    linkers = [Linker(st, layout, r, host="127.0.0.1", port=port, timeout=20.0, key=KEY,
                      limits=limits).start() for r, st in ((0, store0), (1, store1))]
    ends: list[tuple[int, Any]] = []
    try:
        ends = [lk.links.get(timeout=30.0) for lk in linkers]
        assert [peer for peer, _ in ends] == [1, 0]
        assert [link.label for _, link in ends] == ["link/0.1/1.1/"] * 2
        assert all(link.established for _, link in ends)
    finally:
        for lk in linkers:
            lk.stop()
        for _, link in ends:
            link.close()


def test_link_keys_come_from_the_secret_stretched_with_scrypt() -> None:
    """A prefill end proves itself to whoever connects first, so anyone who reaches its port
    holds an HMAC to test guesses at the shared secret against offline. Every derived key
    comes from scrypt of the secret: a guess costs a scrypt (32 MiB), not one HKDF."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    secret = b"correct horse battery staple"
    root = Scrypt(salt=b"atom-core/pd-key/v2", length=32, n=2 ** 15, r=8, p=1).derive(secret)

    def hkdf(k: bytes) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                    info=f"{PROTOCOL} payload mac".encode()).derive(k)

    assert derive_key(secret, "payload mac") == hkdf(root)
    assert derive_key(secret, "payload mac") != hkdf(secret)
