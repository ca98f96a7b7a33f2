"""Transports between PD workers: the in-process pair and its fault hooks, and gloo over loopback
against a real second process (spawned; it runs `_peer` below)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from atom_core.pd.transport import (
    GlooTransport,
    InProcessTransport,
    Message,
    Transport,
    TransportError,
)

MB = 1 << 20


def _samples() -> list[tuple[dict[str, Any], torch.Tensor | None]]:
    g = torch.Generator().manual_seed(0)
    return [
        ({"kind": "kv", "request_id": "r0", "prompt": list(range(4096))},
         torch.randn(2, 3, 5, generator=g)),
        ({"kind": "prefill", "request_id": "r1"}, None),
        ({"kind": "kv", "dtype": "bf16"}, torch.randn(4, 7, generator=g).to(torch.bfloat16)),
        ({"kind": "kv", "dtype": "f64"}, torch.randn(3, 3, dtype=torch.float64, generator=g)),
        ({"kind": "kv", "dtype": "i64"}, torch.tensor([[-(2**62), 5], [7, 2**62]])),
        ({"kind": "kv", "scalar": True}, torch.tensor(3.5)),
        ({"kind": "kv", "empty": True}, torch.empty(0, 4)),
        ({"kind": "kv", "mask": True}, torch.tensor([True, False, True])),
        # Non-contiguous: travels as a contiguous tensor of the same values.
        ({"kind": "kv", "t": True}, torch.arange(12.0).reshape(3, 4).t()),
        ({"kind": "kv", "nan": True}, torch.tensor([float("nan"), float("inf"), -0.0])),
    ]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit-exact: dtype, shape and every byte (NaN payloads and -0.0 included)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).tolist()) == \
        bytes(b.contiguous().reshape(-1).view(torch.uint8).tolist())


def _collect(t: Transport, n: int, timeout: float = 10.0) -> list[Message]:
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        t.wait(deadline - time.monotonic())
        got += t.poll()
    return got


# --- in-process -----------------------------------------------------------------------------


def test_in_process_round_trip() -> None:
    a, b = InProcessTransport.pair()
    assert isinstance(a, Transport) and a.alive and b.alive
    sent = _samples()
    for header, tensor in sent:
        a.send(header, tensor)
    a.send({"kind": "x", "tuple": (1, 2), 3: "int key"})
    got = b.poll()
    assert len(got) == len(sent) + 1
    for (h, t), (h2, t2) in zip(sent, got, strict=False):
        assert h2 == h
        assert _same(t if t is None else t.contiguous(), t2)
    # The receiver gets the JSON round trip, as over a real wire.
    assert got[-1][0] == {"kind": "x", "tuple": [1, 2], "3": "int key"}
    assert b.poll() == []
    # Both directions.
    b.send({"kind": "prefill", "request_id": "r9"})
    assert a.poll() == [({"kind": "prefill", "request_id": "r9"}, None)]
    assert a.stats["messages_sent"] == len(sent) + 1 == b.stats["messages_received"]
    assert a.stats["bytes_sent"] == b.stats["bytes_received"] > 4096


def test_in_process_clones_on_send() -> None:
    a, b = InProcessTransport.pair()
    kv = torch.zeros(4, 4)
    a.send({"kind": "kv"}, kv)
    kv.fill_(1.0)  # the sender reuses its buffer at once
    [(_, got)] = b.poll()
    assert got is not None and torch.equal(got, torch.zeros(4, 4))
    assert got.untyped_storage().data_ptr() != kv.untyped_storage().data_ptr()
    got.fill_(2.0)  # nor does the receiver write into the sender's memory
    assert torch.equal(kv, torch.ones(4, 4))


def test_in_process_rejects_bad_messages() -> None:
    a, _ = InProcessTransport.pair()
    with pytest.raises(ValueError, match="reserved"):
        a.send({"kind": "peer_lost"})
    with pytest.raises(ValueError, match="reserved"):
        a.send({"kind": "bye"})
    with pytest.raises(TypeError, match="JSON"):
        a.send({"kind": "kv", "x": object()})
    with pytest.raises(TypeError, match="dict"):
        a.send(["kind", "kv"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="complex64"):
        a.send({"kind": "kv"}, torch.zeros(2, dtype=torch.complex64))
    assert a.alive


def test_in_process_hold_release() -> None:
    a, b = InProcessTransport.pair()
    a.send({"kind": "kv", "i": 0})
    a.hold()
    a.send({"kind": "kv", "i": 1}, torch.ones(2))
    a.send({"kind": "kv", "i": 2})
    b.send({"kind": "prefill"})  # hold is per direction: b -> a still flows
    assert [h["i"] for h, _ in b.poll()] == [0]
    assert not b.wait(0.05)
    assert a.stats["sends_pending"] == 2
    assert a.poll() == [({"kind": "prefill"}, None)]
    a.release()
    assert [h["i"] for h, _ in b.poll()] == [1, 2]
    a.send({"kind": "kv", "i": 3})
    assert [h["i"] for h, _ in b.poll()] == [3]


def test_in_process_drop_next() -> None:
    a, b = InProcessTransport.pair()
    a.drop_next(2)
    for i in range(3):
        a.send({"kind": "kv", "i": i})
    assert [h["i"] for h, _ in b.poll()] == [2]
    assert a.stats["messages_sent"] == 3 and b.stats["messages_received"] == 1
    a.drop_next()
    a.hold()
    a.send({"kind": "kv", "i": 3})  # dropped, not held
    a.send({"kind": "kv", "i": 4})
    a.release()
    assert [h["i"] for h, _ in b.poll()] == [4]


def test_in_process_kill_reports_peer_lost_once() -> None:
    a, b = InProcessTransport.pair()
    a.send({"kind": "kv", "i": 0})
    a.hold()
    a.send({"kind": "kv", "i": 1})  # in flight when a dies: lost
    a.kill()
    assert not a.alive and not b.alive
    msgs = b.poll()
    assert [h.get("i") for h, _ in msgs] == [0, None]
    assert msgs[-1][0]["kind"] == "peer_lost" and msgs[-1][1] is None
    assert "killed" in msgs[-1][0]["error"]
    assert b.poll() == [] and a.poll() == []
    t0 = time.monotonic()
    assert not b.wait(5.0)  # nothing can come any more: no blocking
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(TransportError, match="peer is gone"):
        b.send({"kind": "prefill"})
    with pytest.raises(TransportError, match="killed"):
        a.send({"kind": "kv"})
    a.release()
    assert b.poll() == []
    a.close()
    b.close()


def test_in_process_close_and_context_manager() -> None:
    a, b = InProcessTransport.pair()
    with a:
        a.hold()
        a.send({"kind": "kv", "i": 0})
    assert not a.alive and not b.alive
    # A graceful close delivers what was in flight, then the loss.
    assert b.poll() == [({"kind": "kv", "i": 0}, None),
                        ({"kind": "peer_lost", "error": "peer closed the connection"}, None)]
    with pytest.raises(TransportError, match="closed"):
        a.send({"kind": "kv"})
    a.close()
    b.close()
    assert a.poll() == [] and b.poll() == []


def test_in_process_wait_wakes_on_send_from_another_thread() -> None:
    a, b = InProcessTransport.pair()
    threading.Timer(0.05, a.send, args=({"kind": "kv"},)).start()
    assert b.wait(10.0)
    assert b.poll() == [({"kind": "kv"}, None)]
    assert not b.wait(0.01)


# --- gloo -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peer(port: int) -> None:
    """The prefill side (rank 1), in a spawned process. Echoes every message with "echo": True
    and obeys commands: "go" (send one big tensor, flush, report), "stream" (send tensors until
    killed), "close" (close first and exit). Exits 0 after a clean close."""
    torch.set_num_threads(1)
    t = GlooTransport(1, port=port, timeout=20.0)
    stream: dict[str, Any] | None = None
    seq = 0
    while True:
        if stream is None:
            t.wait(30.0)
        msgs = t.poll()
        for header, tensor in msgs:
            kind = header["kind"]
            if kind == "peer_lost":
                t.close()
                return
            if kind == "close":
                t.close()
                return
            if kind == "go":
                t.send({"kind": "kv", "big": True}, torch.full((header["numel"],), 1.5))
                t.send({"kind": "flushed", "ok": t.flush(20.0)})
            elif kind == "stream":
                stream = header
            else:
                t.send({**header, "echo": True}, tensor)
        if stream is not None:
            t.send({"kind": "kv", "seq": seq}, torch.full((stream["numel"],), float(seq)))
            seq += 1
            t.flush(20.0)


def _start_peer(timeout: float) -> tuple[GlooTransport, Any]:
    port = _free_port()
    proc = multiprocessing.get_context("spawn").Process(target=_peer, args=(port,), daemon=True)
    proc.start()
    try:
        return GlooTransport(0, port=port, timeout=timeout), proc
    except BaseException:
        proc.kill()
        raise


def _stop_peer(t: GlooTransport, proc: Any) -> None:
    t.close()
    proc.join(10.0)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)


@pytest.fixture
def gloo() -> Iterator[tuple[GlooTransport, Any]]:
    """This process as the decode worker (rank 0) and a spawned prefill worker (rank 1)."""
    t, proc = _start_peer(timeout=20.0)
    try:
        yield t, proc
    finally:
        _stop_peer(t, proc)


def test_gloo_echo_both_directions_bit_exact(gloo: tuple[GlooTransport, Any]) -> None:
    t, proc = gloo
    assert isinstance(t, Transport) and t.alive
    big = torch.randn(MB, generator=torch.Generator().manual_seed(1))
    sent = [({"kind": "kv", "big": True}, big), *_samples()]
    for header, tensor in sent:
        t.send(header, tensor)
    got = _collect(t, len(sent))
    assert len(got) == len(sent)
    for (h, x), (h2, x2) in zip(sent, got, strict=True):
        assert h2 == {**h, "echo": True}
        assert _same(x if x is None else x.contiguous(), x2)
    stats = t.stats
    assert stats["messages_sent"] == stats["messages_received"] == len(sent)
    assert stats["bytes_sent"] == stats["bytes_received"] - len(sent) * len(',"echo":true')
    assert stats["sends_pending"] == 0
    t.close()
    proc.join(10.0)
    assert proc.exitcode == 0  # the peer saw the close as peer_lost and closed too


def test_gloo_poll_does_not_block_while_a_transfer_is_in_flight(
        gloo: tuple[GlooTransport, Any]) -> None:
    t, _ = gloo
    numel = 12 * MB  # 48 MB of float32: many loop iterations while it streams in
    t.send({"kind": "go", "numel": numel})
    iterations = in_flight = 0
    got: list[Message] = []
    deadline = time.monotonic() + 20.0
    while len(got) < 2 and time.monotonic() < deadline:
        got += t.poll()
        iterations += 1
        in_flight += t._receiving  # the receiver thread is mid-message right now
        time.sleep(0.0005)  # this loop's "decode step"
    assert [h["kind"] for h, _ in got] == ["kv", "flushed"]
    assert got[1][0]["ok"]
    kv = got[0][1]
    assert kv is not None and kv.shape == (numel,) and bool((kv == 1.5).all())
    # poll returned, again and again, while a message was partly received.
    assert in_flight >= 2
    assert iterations > in_flight


def test_gloo_sender_is_not_stalled_by_a_busy_receiver(gloo: tuple[GlooTransport, Any]) -> None:
    t, _ = gloo
    t.send({"kind": "go", "numel": 2 * MB})
    # The serving loop neither polls nor waits here; the receiver thread drains the link, so
    # the peer's flush completes and its report arrives behind the tensor.
    deadline = time.monotonic() + 20.0
    while t.stats["messages_received"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    got = t.poll()
    assert [h["kind"] for h, _ in got] == ["kv", "flushed"]
    assert got[1][0] == {"kind": "flushed", "ok": True}


def test_gloo_peer_killed_mid_stream(gloo: tuple[GlooTransport, Any]) -> None:
    t, proc = gloo
    t.send({"kind": "stream", "numel": MB // 4})
    got = _collect(t, 3)
    assert [h["seq"] for h, _ in got[:3]] == [0, 1, 2]
    proc.kill()
    lost: list[Message] = []
    deadline = time.monotonic() + 10.0
    while not lost and time.monotonic() < deadline:
        t.wait(deadline - time.monotonic())
        msgs = t.poll()
        assert all(h["kind"] == "kv" for h, _ in msgs[:-1])
        lost = [m for m in msgs if m[0]["kind"] == "peer_lost"]
    assert len(lost) == 1
    header, tensor = lost[0]
    assert tensor is None and header["error"]
    assert not t.alive
    with pytest.raises(TransportError, match="peer is gone"):
        t.send({"kind": "prefill"})
    assert t.poll() == []  # reported once
    t0 = time.monotonic()
    assert not t.wait(5.0)
    t.close()
    assert time.monotonic() - t0 < 2.0


def test_gloo_peer_closes_first(gloo: tuple[GlooTransport, Any]) -> None:
    t, proc = gloo
    t.send({"kind": "close"})
    got = _collect(t, 1)
    assert got == [({"kind": "peer_lost", "error": "peer closed the connection"}, None)]
    assert not t.alive
    with pytest.raises(TransportError, match="peer closed"):
        t.send({"kind": "prefill"})
    t0 = time.monotonic()
    t.close()
    t.close()
    assert time.monotonic() - t0 < 2.0
    proc.join(10.0)
    assert proc.exitcode == 0


def test_gloo_close_does_not_hang_on_a_hung_peer() -> None:
    # (a generous rendezvous: the spawned peer imports torch, seconds on a loaded machine; the
    # bound under test is close's, read from `timeout` when close runs)
    t, proc = _start_peer(timeout=20.0)
    t.timeout = 2.0
    try:
        t.send({"kind": "kv", "i": 0})
        assert [h["i"] for h, _ in _collect(t, 1)] == [0]
        os.kill(proc.pid, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        t0 = time.monotonic()
        t.close()
        assert time.monotonic() - t0 < 2 * t.timeout + 1.0
        assert not t.alive
        assert t.poll() == []  # our own close is not reported as a loss
    finally:
        proc.kill()
        _stop_peer(t, proc)


def test_gloo_rendezvous_timeout_is_a_transport_error() -> None:
    port = _free_port()
    with pytest.raises(TransportError, match="rank 0: no prefill worker"):
        GlooTransport(0, port=port, timeout=1.0)
    with pytest.raises(TransportError, match="rank 1 could not reach"):
        GlooTransport(1, port=port, timeout=1.0)
    with pytest.raises(ValueError, match="rank must be"):
        GlooTransport(2, port=port)
    with pytest.raises(ValueError, match="wildcard"):
        GlooTransport(0, host="0.0.0.0", port=port)
