"""The authenticated, encrypted PD link (`atom_core.pd.secure_link.SecureLink`): the key
handshake, what a box is bound to (session, direction, kind, request nonce, sequence number),
and attacks on it: in one process over an in-process pair, and in two over gloo on loopback (a
rogue peer without the key, replays from an earlier session, boxes for another request, tampered
control messages)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from atom_core.config import Config
from atom_core.demo import oracle_for
from atom_core.pd.secure_link import LinkError, SecureLink, establish_pair
from atom_core.pd.transport import GlooTransport, InProcessTransport
from atom_core.pd.workers import DecodeWorker
from atom_core.runtime.reference import TorchReferenceRuntime

KEY = b"pd-link-test-key-0123456789abcdef"
OTHER_KEY = b"pd-link-other-key-0123456789abcd"
ROOT = Path(__file__).resolve().parents[1]
N0, N1 = "0" * 31 + "a", "0" * 31 + "b"  # request nonces


class Tap:
    """An in-process end that records what this end sends (the wire), for replays."""

    def __init__(self, inner: InProcessTransport) -> None:
        self.inner, self.sent = inner, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def alive(self) -> bool:
        return self.inner.alive

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        self.sent.append((dict(header), None if tensor is None else tensor.clone()))
        self.inner.send(header, tensor)


def pair(dkey: bytes = KEY, pkey: bytes = KEY, **kw: Any
         ) -> tuple[SecureLink, SecureLink, Tap, Tap]:
    td, tp = InProcessTransport.pair()
    wd, wp = Tap(td), Tap(tp)
    return SecureLink(wd, dkey, "decode", **kw), SecureLink(wp, pkey, "prefill", **kw), wd, wp


def test_handshake_round_trip_and_nothing_in_clear() -> None:
    d, p, wd, wp = pair()
    establish_pair(d, p)
    assert d.session_id == p.session_id and len(d.session_id or b"") == 16
    prompt = list(range(1000, 1100))
    kv = torch.randn(2, 2, 3, 7, 4, generator=torch.Generator().manual_seed(0))
    d.send({"kind": "prefill", "id": "0", "nonce": N0, "prompt": prompt})
    p.send({"kind": "kv", "request_id": "0", "nonce": N0}, kv)
    p.send({"kind": "x"}, torch.tensor([True, False]))
    p.send({"kind": "y"}, torch.zeros(0, 3, dtype=torch.bfloat16))
    (h, t), = p.poll()
    assert h == {"kind": "prefill", "id": "0", "nonce": N0, "prompt": prompt} and t is None
    got = d.poll()
    assert [m[0]["kind"] for m in got] == ["kv", "x", "y"]
    assert torch.equal(got[0][1], kv) and torch.equal(got[1][1], torch.tensor([True, False]))
    assert got[2][1].shape == (0, 3) and got[2][1].dtype == torch.bfloat16
    # the wire: envelopes and boxes only; neither the prompt nor the KV bytes appear
    wire = b"".join(bytes(t.numpy()) for h, t in wd.sent + wp.sent if t is not None)
    assert "1000,1001" not in json.dumps([h for h, _ in wd.sent + wp.sent])
    assert bytes(kv.reshape(-1).view(torch.uint8)[:64].numpy()) not in wire
    assert {h["kind"] for h, _ in wd.sent[2:] + wp.sent[1:]} == {"sealed"}
    # a new session has other keys and id
    d2, p2, _, _ = pair()
    establish_pair(d2, p2)
    assert d2.session_id != d.session_id


def test_a_peer_with_another_key_is_refused_and_learns_nothing() -> None:
    d, p, wd, wp = pair(pkey=OTHER_KEY)
    d.send({"kind": "prefill", "id": "0", "nonce": N0, "prompt": [1, 2, 3]})  # queued
    with pytest.raises(LinkError, match="failed the key challenge"):
        establish_pair(d, p)
    assert not d.alive and not d.established and not p.established
    # all the decode side ever sent: its hello (fresh random bytes); the queued request never
    assert [h["kind"] for h, _ in wd.sent] == ["hello"] and set(wd.sent[0][0]) == {
        "kind", "v", "role", "nonce"}
    assert d.poll()[-1][0]["kind"] == "peer_lost"
    with pytest.raises(Exception, match="failed the key challenge"):
        d.send({"kind": "prefill", "id": "1", "nonce": N1, "prompt": [1]})
    # the other way round: the decode side is the impostor; the prefill side never proves
    # anything beyond its own hello, and takes nothing
    d, p, wd, wp = pair(dkey=OTHER_KEY)
    with pytest.raises(LinkError):
        establish_pair(d, p)
    assert not p.established and [h["kind"] for h, _ in wp.sent] == ["hello"]


def test_replays_other_sessions_requests_directions_and_tampering_are_dropped() -> None:
    d, p, wd, wp = pair()
    establish_pair(d, p)
    p.send({"kind": "kv", "request_id": "0", "nonce": N0}, torch.ones(5))
    p.send({"kind": "prefill_failed", "id": "1", "nonce": N1, "error": "x"})
    assert len(d.poll()) == 2
    kv_box, ctl_box = wp.sent[-2], wp.sent[-1]
    inject = wp.inner.send  # straight onto the wire, as an attacker would

    inject(*kv_box)  # the same box again
    # boxes taken off the wire before delivery (fresh sequence numbers), then relabelled
    for _ in range(3):
        wp.inner.drop_next(1)
        p.send({"kind": "prefill_failed", "id": "1", "nonce": N1, "error": "y"})
    (h1, t1), (h2, t2), (h3, t3) = wp.sent[-3:]
    inject({**h1, "rn": N0}, t1)  # for another request
    inject({**h2, "k": "cancel"}, t2)  # another kind
    bad = t3.clone()
    bad[20] ^= 1
    inject(h3, bad)  # a tampered control message
    wd.inner.send(*kv_box)  # reflected back at its sender: the other direction
    assert d.poll() == [] and p.poll() == []
    assert d.dropped == {"replay": 1, "auth": 3} and p.dropped == {"auth": 1}
    inject(h1, t1)  # untouched, the same box is taken: only the relabelling was refused
    assert [m[0]["error"] for m in d.poll()] == ["y"]
    # from an earlier session: another session id and keys
    d2, p2, _, wp2 = pair()
    establish_pair(d2, p2)
    wp2.inner.send(*kv_box)
    wp2.inner.send(*ctl_box)
    assert d2.poll() == [] and d2.dropped == {"auth": 2}
    # the link still works, and an authentic box is still taken
    p.send({"kind": "kv", "request_id": "2", "nonce": N0}, torch.zeros(2))
    assert [m[0]["request_id"] for m in d.poll()] == ["2"]


def test_reserved_oversized_and_unsealed_are_dropped() -> None:
    d, p, wd, wp = pair(max_box_bytes=4096)
    establish_pair(d, p)
    for kind in ("peer_lost", "bye", "sealed", "hello", "proof"):
        with pytest.raises(ValueError, match="reserved"):
            p.send({"kind": kind})
    p.send({"kind": "kv", "request_id": "0"}, torch.zeros(2000))  # an 8 KB box
    h, t = wp.sent[-1]
    wp.inner.send({**h, "seq": 7, "k": "peer_lost"}, t)
    wp.inner.send({"kind": "kv", "request_id": "0"}, torch.zeros(3))  # not sealed
    wp.inner.send({"kind": "sealed", "k": "kv", "rn": "", "seq": -1}, t)
    assert d.poll() == []
    assert d.dropped == {"oversized": 1, "reserved": 1, "unsealed": 1, "malformed": 1}


# --------------------------------------------------------------------------- gloo
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ROGUE = """
import json, os, sys
from atom_core.pd.secure_link import PROTOCOL
from atom_core.pd.transport import GlooTransport
t = GlooTransport(1, port=int(sys.argv[1]), timeout=20.0)
got = []
while t.alive:
    t.wait(5.0)
    msgs = t.poll()
    got += [h for h, _ in msgs]
    if any(h["kind"] == "hello" for h, _ in msgs):
        # a guess at the handshake, without the key
        t.send({"kind": "hello", "v": PROTOCOL, "role": "prefill",
                "nonce": os.urandom(32).hex(), "proof": os.urandom(32).hex()})
print(json.dumps(got))
"""


def test_gloo_rogue_peer_without_the_key_is_refused_at_the_handshake() -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", ROGUE, str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cfg = Config(lanes=1, kv_blocks=2, max_seq_len=128, prefill_chunk=64)
        rt = TorchReferenceRuntime.tiny(cfg)
        link = SecureLink(GlooTransport(0, port=port, timeout=20.0), KEY, "decode")
        dw = DecodeWorker(cfg, rt, link, key=KEY, transfer_timeout=20.0)
        wid = dw.submit([1, 2, 3], 3)
        res = dw.run_until_done(timeout=30.0)
        assert "failed the key challenge" in (dw.lost or "")
        # its request ends either way, never with another's tokens: if it already held a lane
        # waiting for that peer's KV it fails (nothing was sent for it); if the handshake
        # failed before it was admitted (a race with the rogue's reply), it is prefilled here
        want = oracle_for(rt).generate([1, 2, 3], 3)
        first = res[wid]
        assert ("prefill worker lost" in (first.error or "")
                or (first.error is None and first.tokens == want)), first
        late = dw.submit([1, 2, 3], 3)  # and the worker goes on serving, by local prefill
        assert dw.run_until_done(timeout=30.0)[late].tokens == want
        dw.close()
        out, err = proc.communicate(timeout=20)
        got = json.loads(out.strip().splitlines()[-1])
        # all the rogue learned: the decode side's hello (a fresh nonce), then the loss
        assert [h["kind"] for h in got] == ["hello", "peer_lost"], got
        assert set(got[0]) == {"kind", "v", "role", "nonce"}
        assert "1, 2, 3" not in out and "[1,2,3]" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


PREFILL = f"""
import json, sys, torch
from atom_core.config import Config
from atom_core.pd.secure_link import SecureLink
from atom_core.runtime.reference import TorchReferenceRuntime
from atom_core.pd.transport import GlooTransport
from atom_core.pd.workers import PrefillWorker

port, mode, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]


class Attack:
    # the wire under the prefill worker's link: records (session 1) or, before the first real
    # kv box of session 2, injects what an attacker on the path could
    def __init__(self, inner):
        self.inner, self.sent, self.rns, self.fired = inner, [], [], False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def alive(self):
        return self.inner.alive

    def poll(self):
        msgs = self.inner.poll()
        self.rns += [h["rn"] for h, _ in msgs if h.get("k") == "prefill"]
        return msgs

    def send(self, h, t=None):
        self.sent.append((h, t))
        if mode == "attack" and h.get("k") == "kv" and not self.fired:
            self.fired = True
            old = next(m for m in torch.load(path) if m[0].get("k") == "kv")
            self.inner.send(*old)  # replay from an earlier session
            other = next((rn for rn in self.rns if rn != h["rn"]), "0" * 31 + "c")
            self.inner.send({{**h, "rn": other}}, t)  # the box, for another request
            self.inner.send({{**h, "k": "prefill_failed"}}, t)  # relabelled as a control message
            bad = t.clone()
            bad[-3] ^= 0x40
            self.inner.send(h, bad)  # tampered
            self.inner.send(h, t)  # the real one
            self.inner.send(h, t)  # and a replay within the session
            return
        self.inner.send(h, t)


cfg = Config(lanes=2, kv_blocks=3, max_seq_len=128, prefill_chunk=64)
wire = Attack(GlooTransport(1, port=port, timeout=20.0))
link = SecureLink(wire, {KEY!r}, "prefill")
worker = PrefillWorker(cfg, TorchReferenceRuntime.tiny(cfg), link, key={KEY!r})
worker.serve()
link.close()
if mode == "record":
    torch.save(wire.sent, path)
print(json.dumps({{"exports": worker.stats.exports, "dropped": dict(link.dropped)}}))
"""


def _session(mode: str, path: Path) -> tuple[DecodeWorker, dict[str, Any]]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", PREFILL, str(port), mode, str(path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ})
    try:
        cfg = Config(lanes=2, kv_blocks=3, max_seq_len=128, prefill_chunk=64)
        rt = TorchReferenceRuntime.tiny(cfg)
        dw = DecodeWorker(cfg, rt, GlooTransport(0, port=port, timeout=20.0), key=KEY,
                          fallback_local=False, transfer_timeout=20.0, prefetch=2)
        prompts = [[7, 8, 9, 10], list(range(20, 60)), [3] * 9]
        wids = [dw.submit(p, 4) for p in prompts]
        res = dw.run_until_done(timeout=30.0)
        oracle = oracle_for(rt)
        for w, p in zip(wids, prompts, strict=True):  # every request served, exactly
            assert res[w].error is None and res[w].tokens == oracle.generate(p, 4), res[w]
        dw.close()
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        return dw, json.loads(out.strip().splitlines()[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_gloo_replays_misdirected_and_tampered_boxes_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "session1.pt"
    dw, stats = _session("record", path)
    assert dw.transport.dropped == {} and stats["exports"] == 3
    dw, stats = _session("attack", path)
    # earlier session, another request, relabelled control, tampered: the AEAD refuses each;
    # the repeat of the real box: the replay window. None reached the worker.
    assert dw.transport.dropped == {"auth": 4, "replay": 1}
    assert dw.summary()["link_dropped"] == {"auth": 4, "replay": 1}
    assert dw.misdirected == dw.stale_messages == dw.bad_messages == 0
    assert dw.batcher.stats.imported_tokens == 4 + 40 + 9
