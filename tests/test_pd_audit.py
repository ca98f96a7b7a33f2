"""Findings of an audit of the PD transport, each pinned by a test that failed before its fix:

- a link replaced by a restarted peer's new link before the old one's loss was polled: its
  requests were neither asked again (a decode worker waited for them until its transfer
  timeout) nor cancelled (a prefill worker shipped the old decode process's KV to the new one);
- malformed prefill requests left an entry in a prefill worker's `DecodeLinks` forever;
- a closing gloo transport queued, without bound, whatever the peer kept sending until close
  gave up on it;
- the insecure mode ran without a word, and dropped boxes without one.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cluster import S, assert_clean, assert_exact, config, runtime

from atom_core.demo import oracle_for, workload
from atom_core.pd.cluster import LocalCluster
from atom_core.pd.links import DecodeLinks
from atom_core.pd.secure_link import SecureLink, establish_pair
from atom_core.pd.transport import GlooTransport, InProcessTransport
from atom_core.pd.workers import DecodeWorker, PrefillWorker

KEY = b"audit-test-key-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- restarts
def test_a_prefill_worker_restarted_before_its_loss_is_seen_gets_its_requests_again() -> None:
    # a transfer timeout far beyond the test: before the fix the requests asked of the dead
    # process waited for it (the replaced link was closed and never polled again)
    c = LocalCluster(config(), runtime, prefill=1, decode=1, key=KEY,
                     decode_options={"transfer_timeout": 1e6})
    cids = [c.submit(it.prompt, it.max_new_tokens) for it in workload(4, 6, 0, 128, S)]
    for _ in range(50):
        c.step()
        if c.decodes[0].links.busy():
            break
    assert c.decodes[0].links.busy()  # a prefill request is in flight when the process dies
    c.kill("prefill", 0)
    c.start("prefill", 0)  # its new link replaces the old one before anyone polled the loss
    c.run_until_done(rounds=3000)
    assert_exact(c, cids)
    # not left waiting: the new link came before the restarted process reported ready, so the
    # decode worker had no prefill worker to ask (a process is asked only once the frontend
    # names its generation ready, tests/test_pd_restart_audit.py) and prefilled them locally
    assert c.decodes[0].worker.local_fallbacks > 0
    assert_clean(c)


def test_a_decode_worker_restarted_before_its_loss_is_seen_gets_nothing_of_the_old_one(
        ) -> None:
    c = LocalCluster(config(), runtime, prefill=1, decode=1, key=KEY)
    for it in workload(4, 6, 0, 128, S):
        c.submit(it.prompt, it.max_new_tokens)
    for _ in range(50):
        c.step()
        if c.prefills[0].links.pending():
            break
    held = c.prefills[0].links.pending()
    assert held > 0  # the prefill worker holds the old decode process's requests
    c.kill("decode", 0)
    c.start("decode", 0)
    c.step()
    c.step()
    more = [c.submit(it.prompt, it.max_new_tokens) for it in workload(4, 6, 5, 128, S)]
    c.run_until_done(rounds=3000)
    assert_exact(c, more)
    # the old process's requests were cancelled on the prefill side (blocks freed), and
    # nothing meant for it went to the new process (before the fix: its KV, counted stale)
    assert c.prefills[0].worker.stats.cancelled == held
    assert c.decodes[0].worker.stale_messages == 0
    assert c.decodes[0].worker.misdirected == 0
    assert_clean(c)


# --------------------------------------------------------------------------- bounded state
def test_malformed_prefill_requests_leave_nothing_behind() -> None:
    links = DecodeLinks(secure=False)
    d, p = InProcessTransport.pair()
    links.add(0, p)
    good = "0" * 32
    bad = [{"kind": "prefill", "id": "a", "nonce": "not-a-nonce", "prompt": [1]},
           {"kind": "prefill", "id": "b", "prompt": [1]},
           {"kind": "prefill", "id": "c" * 65, "nonce": good, "prompt": [1]},
           {"kind": "prefill", "id": 7, "nonce": good, "prompt": [1]}]
    for h in bad:
        d.send(h)
    assert links.poll() == []  # none reaches the worker, which would drop them unanswered
    assert links.pending() == 0 and links.refused == len(bad)
    d.send({"kind": "prefill", "id": "ok", "nonce": good, "prompt": [1]})
    assert [h["id"] for h, _ in links.poll()] == ["ok"] and links.pending() == 1


# A rank 1 that floods rank 0 and never answers its close: its receiver takes the bye without
# answering (as a hung or hostile peer's would), its sender keeps shipping small messages.
FLOOD = """
import sys, torch
from atom_core.pd.transport import GlooTransport
t = GlooTransport(1, port=int(sys.argv[1]), timeout=20.0)
t._closing = True
for _ in range(3000):
    t._outbox.put((b'{"kind":"x"}', torch.zeros(64)))
t.wait(60.0)
"""


def test_gloo_close_drops_what_a_peer_keeps_sending() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-c", FLOOD, str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t = None
    try:
        t = GlooTransport(0, port=port, timeout=20.0, inbox_messages=8)
        deadline = time.monotonic() + 15.0
        while len(t._inbox._items) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(t._inbox._items) == 8  # full: the receiver waits for room
        t.timeout = 1.5  # close's bound (read when close runs)
        t.close()  # the peer never answers: close gives up after timeout + 1 s
        # before the fix the inbox was unbounded from close on: hundreds of messages
        assert len(t._inbox._items) == 8
    finally:
        proc.kill()
        proc.communicate(timeout=10)
        if t is not None:
            # the abandoned receiver leaves once the peer's socket is gone
            t._receiver.join(10.0)
            assert not t._receiver.is_alive()


# --------------------------------------------------------------------------- said aloud
def test_insecure_workers_say_so(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config()
    a, b = InProcessTransport.pair()
    with caplog.at_level(logging.WARNING, logger="atom_core.pd.workers"):
        PrefillWorker(cfg, runtime(cfg), a, insecure=True)
        DecodeWorker(cfg, runtime(cfg), b, insecure=True)
    warned = [r for r in caplog.records if "WITHOUT a key" in r.getMessage()]
    assert len(warned) == 2
    caplog.clear()
    c, d = InProcessTransport.pair()
    with caplog.at_level(logging.WARNING, logger="atom_core.pd.workers"):
        PrefillWorker(cfg, runtime(cfg), c, key=KEY)
    assert not [r for r in caplog.records if "WITHOUT a key" in r.getMessage()]


class Mangle:
    """The wire under the prefill worker's SecureLink: the first sealed kv box is mangled by
    `how` (what an attacker on the path could do); the rest pass."""

    def __init__(self, inner: InProcessTransport, how: str) -> None:
        self.inner, self.how, self.fired, self.rn = inner, how, False, ""

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        if header.get("k") == "kv" and not self.fired and tensor is not None:
            self.fired, self.rn = True, header["rn"]
            if self.how == "flip":
                tensor = tensor.clone()
                tensor[len(tensor) // 2] ^= 0x01
            elif self.how == "truncate":
                tensor = tensor[:-1]
            elif self.how == "extend":
                tensor = torch.cat([tensor, torch.zeros(1, dtype=torch.uint8)])
        self.inner.send(header, tensor)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("how", ["flip", "truncate", "extend"])
def test_a_mangled_box_is_logged_and_only_its_request_fails(
        how: str, caplog: pytest.LogCaptureFixture) -> None:
    cfg = config()
    now = [0.0]  # the decode worker's clock: only the test moves it
    td, tp = InProcessTransport.pair()
    wire = Mangle(tp, how)
    dlink = SecureLink(td, KEY, "decode", clock=lambda: now[0])
    plink = SecureLink(wire, KEY, "prefill")  # type: ignore[arg-type]
    establish_pair(dlink, plink)
    pw = PrefillWorker(cfg, runtime(cfg), plink, key=KEY)
    dw = DecodeWorker(cfg, runtime(cfg), dlink, key=KEY, transfer_timeout=5.0,
                      clock=lambda: now[0])
    items = workload(4, 6, 1, 128, S)
    wids = [dw.submit(it.prompt, it.max_new_tokens) for it in items]
    with caplog.at_level(logging.WARNING, logger="atom_core.pd.secure_link"):
        for _ in range(3000):
            if not dw.busy():
                break
            dw.step()
            pw.step_once()
            if wire.fired and pw.stats.exports == len(items) and not pw.batcher.busy():
                now[0] += 1.0  # every answer is out: let the lost one's timeout run
    assert not dw.busy()
    assert dlink.dropped == {"auth": 1}
    logged = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(logged) == 1
    assert "decode side" in logged[0] and "fails authentication" in logged[0]
    assert wire.rn[:8] in logged[0]  # names the request (its nonce)
    res = dw.results()
    victim = next(w for w in wids if dw.requests[w].nonce == wire.rn)
    assert "did not answer within 5s" in (res[victim].error or "")
    oracle = oracle_for(runtime(cfg))
    for w, it in zip(wids, items, strict=True):
        if w != victim:
            assert res[w].error is None and res[w].tokens == oracle.generate(
                it.prompt, it.max_new_tokens)
    b = dw.batcher
    assert b.transfers() == {} and not any(b.state.busy)  # the victim's blocks were freed
    b.check_invariants()
