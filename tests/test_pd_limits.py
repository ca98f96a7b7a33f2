"""Limits on what a PD peer can make a worker hold: frame sizes from the config (refused before
any allocation, asserted on the transport's allocator), bounded inboxes and prefill queue,
reserved kinds from the wire dropped, and import_kv taking exactly the runtime's host layout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch

from atom_core.batcher import AtomBatcher
from atom_core.config import Config
from atom_core.pd import payload as pd
from atom_core.pd.transport import GlooTransport, InProcessTransport, TransportError
from atom_core.pd.workers import PrefillWorker
from atom_core.runtime.protocol import capabilities
from atom_core.runtime.reference import TorchReferenceRuntime

S, C = 128, 64
ROOT = Path(__file__).resolve().parents[1]
CFG = Config(lanes=2, kv_blocks=3, max_seq_len=S, prefill_chunk=C)


def test_frame_limits_follow_the_config() -> None:
    rt = TorchReferenceRuntime.tiny(CFG)
    layers, kv, heads, _, dim = rt.new_host_buffer().shape
    lim = pd.frame_limits(CFG, rt)
    assert lim.tensor_bytes == layers * kv * heads * S * dim * 4
    # a header with a max_seq_len prompt of the largest token ids fits
    header, _ = pd.to_wire(pd.make_payload(
        "x" * 200, [rt.vocab_size - 1] * S, 1,
        torch.zeros(layers, kv, heads, S, dim), "f" * 1000))
    assert len(str(header).encode()) < lim.header_bytes < 64 << 10
    # a longer table or a hybrid ring raises the limit, by exactly the ring
    assert pd.frame_limits(Config(lanes=2, kv_blocks=3, max_seq_len=2 * S, prefill_chunk=C),
                           TorchReferenceRuntime.tiny(Config(
                               lanes=2, kv_blocks=3, max_seq_len=2 * S, prefill_chunk=C))
                           ).tensor_bytes == 2 * lim.tensor_bytes
    hcfg = Config(lanes=2, kv_blocks=3, max_seq_len=S, prefill_chunk=C, sliding_window=16)
    hrt = TorchReferenceRuntime.tiny(hcfg, sliding_window=16, layers=3, global_every=3)
    ring = hrt.new_local_host_buffer()
    hh = hrt.new_host_buffer()
    assert pd.frame_limits(hcfg, hrt).tensor_bytes == \
        hh.numel() // hh.shape[3] * S * 4 + ring.numel() * 4


def test_frame_limits_read_the_vocabulary_from_the_capabilities() -> None:
    rt = TorchReferenceRuntime.tiny(CFG)
    caps = capabilities(rt)
    lim = pd.frame_limits(CFG, rt, caps)
    assert lim == pd.frame_limits(CFG, rt)  # (read here when not given)
    # the header bound is digits per token: a vocabulary of 10**6 takes 7 per token, not 4
    wide = pd.frame_limits(CFG, rt, attrs.evolve(caps, vocab_size=10**6))
    assert wide.header_bytes - lim.header_bytes == S * (7 - 4)
    assert wide.tensor_bytes == lim.tensor_bytes
    # a runtime that does not know its vocabulary (None) gets the widest token ids' bound
    unknown = pd.frame_limits(CFG, rt, attrs.evolve(caps, vocab_size=None))
    assert unknown.header_bytes - lim.header_bytes == S * (len(str((1 << 31) - 1)) - 3)


def test_in_process_inbox_is_bounded() -> None:
    a, b = InProcessTransport.pair(inbox_messages=3)
    for i in range(3):
        a.send({"kind": "x", "i": i})
    with pytest.raises(TransportError, match="inbox full"):
        for i in range(2):
            a.send({"kind": "x", "i": 3 + i})
    got = b.poll()
    assert [h.get("i") for h, _ in got[:3]] == [0, 1, 2]  # what fit arrives, in order
    assert got[3][0]["kind"] == "peer_lost" and not a.alive and not b.alive
    assert a.poll()[-1][0]["kind"] == "peer_lost"  # the sender learns it too


def test_prefill_queue_is_bounded() -> None:
    td, tp = InProcessTransport.pair()
    rt = TorchReferenceRuntime.tiny(CFG)
    pw = PrefillWorker(CFG, rt, tp, max_queued=2, insecure=True)
    for i in range(4):
        td.send({"kind": "prefill", "id": str(i), "prompt": [1, 2, 3], "nonce": f"{i:032x}"})
    pw.step_once()
    answers = [h for h, _ in td.poll() if h["kind"] == "prefill_failed"]
    assert [(h["kind"], h["id"]) for h in answers] == [("prefill_failed", "2"),
                                                          ("prefill_failed", "3")]
    assert "max_queued" in answers[0]["error"]
    assert pw.stats.requests == 4 and pw.stats.failures == 2


# --------------------------------------------------------------------------- import_kv
def _importing(d: AtomBatcher, prompt: list[int]) -> int:
    rid = d.submit(prompt, 3, remote=True)
    for _ in range(10):
        if d.awaits_kv(rid):
            return rid
        d.step()
    raise AssertionError("no import event")


@pytest.mark.parametrize("make, field", [
    (lambda b: b[:1], "layers"),  # would broadcast over every layer
    (lambda b: b[:, :, :1], "kv_heads"),
    (lambda b: b[..., :1], "head_dim"),
    (lambda b: b.to(torch.float64), "dtype"),
    (lambda b: b.to(torch.float16), "dtype"),
    (lambda b: torch.cat([b, b], dim=3), "positions"),
    (lambda b: b.numpy(), "torch.Tensor"),
])
def test_import_kv_takes_exactly_the_host_layout(make, field: str) -> None:
    rt = TorchReferenceRuntime.tiny(CFG)
    d = AtomBatcher(CFG, rt, ghost=True)
    prompt = [3, 1, 4, 1, 5]
    rid = _importing(d, prompt)
    good = d.new_import_buffer()
    updates = rt.calls["update"]
    ev = d.import_kv(rid, prompt, 7, make(good))
    assert [e.kind for e in ev] == ["error"]
    assert ev[0].error.startswith("import rejected (host_kv)") and field in ev[0].error
    assert rt.calls["update"] == updates  # refused before anything was written
    d.check_invariants()
    rid2 = _importing(d, prompt)
    assert [e.kind for e in d.import_kv(rid2, prompt, 7, good)] == ["token"]


# --------------------------------------------------------------------------- gloo
ROGUE = """
import sys, torch
from atom_core.pd.transport import GlooTransport
t = GlooTransport(1, port=int(sys.argv[1]), timeout=20.0)
what = sys.argv[2]
if what == "oversized":
    # a meta announcing one byte more than the decode side's limit, then nothing
    t._pg.send([torch.tensor([2, int(sys.argv[3]) + 1, 9, 1])], 0, 1001).wait()
elif what == "peer_lost":
    t._outbox.put((b'{"kind":"peer_lost","error":"forged"}', None))
    t.send({"kind": "hello"})
    t.flush(10.0)
t.wait(10.0)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rogue(*args: str) -> tuple[subprocess.Popen[str], int]:
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-c", ROGUE, str(port), *args], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, port


def _lost(t: GlooTransport, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        t.wait(0.5)
        for h, _ in t.poll():
            if h["kind"] == "peer_lost":
                return str(h["error"])
    raise AssertionError("no peer_lost")


def test_gloo_oversized_frame_is_refused_before_allocation() -> None:
    lim = pd.frame_limits(CFG, TorchReferenceRuntime.tiny(CFG))
    proc, port = _rogue("oversized", str(lim.tensor_bytes))
    try:
        t = GlooTransport(0, port=port, timeout=20.0, max_header_bytes=lim.header_bytes,
                          max_tensor_bytes=lim.tensor_bytes)
        why = _lost(t)
        assert f"announced a tensor of {lim.tensor_bytes + 1} bytes" in why
        # the allocator saw the 32-byte meta and nothing else
        assert t.largest_alloc == 32
        t.close()
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def test_gloo_reserved_kind_from_the_wire_is_dropped() -> None:
    proc, port = _rogue("peer_lost")
    try:
        t = GlooTransport(0, port=port, timeout=20.0)
        deadline = time.monotonic() + 15.0
        got: list[dict] = []
        while not got and time.monotonic() < deadline:
            t.wait(0.5)
            got = [h for h, _ in t.poll()]
        assert got == [{"kind": "hello"}] and t.alive and t.reserved_dropped == 1
        t.close()
    finally:
        proc.kill()
        proc.communicate(timeout=10)
