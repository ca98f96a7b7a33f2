"""PD workers end to end: a prefill worker and a decode worker, in one thread over an in-process
transport (exactness, overlap, every payload fault, aborts, late messages, a lost peer) and in
two processes over gloo on loopback (exactness, the prefill process killed mid-transfer), plus
the CLI's argument errors."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from atom_core import cli
from atom_core._generated import core
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.pd import payload as pd
from atom_core.pd.secure_link import SecureLink, derive_key
from atom_core.pd.transport import GlooTransport, InProcessTransport
from atom_core.pd.workers import DecodeWorker, PrefillWorker
from atom_core.runtime.reference import TorchReferenceRuntime

S, C = 128, 64
KEY = b"pd-test-key-0123456789abcdef"
OTHER_KEY = b"another-key-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[1]


def config(lanes: int, prefix: bool = False, scratch: str = "dynamic", extra: int = 1,
           max_seq_len: int = S) -> Config:
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch) + extra,
                  max_seq_len=max_seq_len, prefill_chunk=C, prefix_cache=prefix,
                  scratch=scratch)


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(128) for _ in range(70)]  # some share a prefix: prefill-side hits
    out = []
    for i in range(n):
        tail = [rng.randrange(128) for _ in range(rng.randint(lo, hi))]
        out.append((shared + tail)[:hi] if i % 3 == 0 else tail)
    return out


@attrs.define
class Rig:
    dw: DecodeWorker
    pw: PrefillWorker
    to_prefill: InProcessTransport  # the decode worker's end
    to_decode: InProcessTransport  # the prefill worker's end (fault hooks act on its sends)

    def pump(self, until: Callable[[], bool] | None = None, rounds: int = 5000) -> None:
        """Step both workers alternately until `until()` (default: the decode side is done)."""
        done = until or (lambda: not self.dw.busy())
        for _ in range(rounds):
            if done():
                return
            self.dw.step()
            self.pw.step_once()
        raise AssertionError(f"not done after {rounds} rounds")

    def exact(self, wid: int, max_new: int) -> None:
        req = self.dw.requests[wid]
        res = self.dw.results()[wid]
        assert res.error is None, res.error
        assert res.tokens == oracle_for(self.dw.runtime).generate(req.prompt, max_new)


def rig(dcfg: Config, pcfg: Config | None = None, *, dkey: bytes | None = None,
        pkey: bytes | None = None, pseed: int = 0, fallback_local: bool = True,
        transfer_timeout: float | None = None, prefetch: int = 0,
        wrap: Callable[[InProcessTransport], Any] | None = None,
        clock: Callable[[], float] = time.perf_counter) -> Rig:
    pcfg = pcfg or config(2, prefix=True)
    td, tp = InProcessTransport.pair()
    rd = TorchReferenceRuntime.tiny(dcfg, seed=0)
    rp = TorchReferenceRuntime.tiny(pcfg, seed=pseed)
    # no key: an unauthenticated link, explicitly (the workers refuse it otherwise). With a key
    # the prefill end is a SecureLink, and `wrap` acts above it (on what the worker sends).
    ptr: Any = tp if pkey is None else SecureLink(tp, pkey, "prefill")
    pw = PrefillWorker(pcfg, rp, wrap(ptr) if wrap else ptr, key=pkey, insecure=pkey is None)
    dw = DecodeWorker(dcfg, rd, td, key=dkey, insecure=dkey is None,
                      fallback_local=fallback_local,
                      transfer_timeout=transfer_timeout or 1e9, prefetch=prefetch,
                      clock=clock)
    return Rig(dw, pw, td, tp)


def assert_clean(worker: DecodeWorker | PrefillWorker) -> None:
    """Nothing leaked: no transfer, no busy lane, every block free, cached or the scratch."""
    b = worker.batcher
    assert b.transfers() == {}
    assert not any(b.state.busy)
    owners = core.describe_state(b.state)["owner"]
    assert set(owners) <= {"FREE", "CACHE", "SCRATCH"}, owners
    b.check_invariants()


def settle(r: Rig) -> None:
    """Let the prefill side finish whatever it still holds, then check both sides."""
    r.pump(lambda: not r.dw.busy() and not r.pw.batcher.busy())
    assert_clean(r.dw)
    assert_clean(r.pw)


def serve_more(r: Rig, n: int = 2, seed: int = 99) -> None:
    """The decode worker keeps serving after a fault."""
    wids = [r.dw.submit(p, 5) for p in prompts(n, seed)]
    r.pump()
    for w in wids:
        r.exact(w, 5)
    settle(r)


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("dcfg,pcfg", [
    (config(1, extra=0), config(1)),
    (config(2), config(2, prefix=True)),
    (config(3, scratch="reserved", extra=0), config(1, prefix=True, scratch="reserved")),
    (config(4, prefix=True), config(3, prefix=True, extra=0)),
    (config(2, extra=0), config(2, prefix=True, max_seq_len=2 * S)),  # sizes may differ
], ids=["1-lane", "2-lanes", "3-lanes-reserved", "4-lanes-prefix", "min-blocks"])
@pytest.mark.parametrize("prefetch", [0, 3])
def test_in_process_outputs_equal_the_oracle(dcfg: Config, pcfg: Config, prefetch: int) -> None:
    r = rig(dcfg, pcfg, prefetch=prefetch)
    ps = prompts(9, seed=dcfg.lanes)
    wids = [r.dw.submit(p, 1 + i % 7) for i, p in enumerate(ps)]
    r.pump()
    for i, w in enumerate(wids):
        r.exact(w, 1 + i % 7)
    s = r.dw.summary()
    assert s["completed"] == 9 and s["failed"] == 0
    assert s["imported_tokens"] == sum(map(len, ps)) and s["local_prefill_tokens"] == 0
    assert s["bytes_received"] > 0 and s["latency_median_s"] is not None
    assert r.pw.stats.exports == 9
    settle(r)


def test_authenticated_run_is_exact_and_unsigned_payloads_never_import() -> None:
    r = rig(config(2), dkey=KEY, pkey=KEY)
    wids = [r.dw.submit(p, 4) for p in prompts(4)]
    r.pump()
    for w in wids:
        r.exact(w, 4)
    assert r.dw.auth_failures == 0
    assert r.dw.summary()["link_dropped"] == {}
    # A prefill worker without the key never answers the handshake: the decode side sends it
    # nothing but its hello and drops the link when the handshake times out: the requests
    # holding a lane fail as on any loss, the waiting one is prefilled locally.
    now = [0.0]
    td, tp = InProcessTransport.pair()
    cfg = config(2)
    rt = TorchReferenceRuntime.tiny(cfg)
    dw = DecodeWorker(cfg, rt, SecureLink(td, KEY, "decode", handshake_timeout=5.0,
                                          clock=lambda: now[0]), key=KEY)
    pw = PrefillWorker(cfg, TorchReferenceRuntime.tiny(cfg), tp, insecure=True)
    wids = [dw.submit(p, 4) for p in prompts(3)]
    for _ in range(20):
        dw.step()
        pw.step_once()
    assert pw.stats.requests == 0 and pw.stats.ignored == 1  # the hello, nothing else
    assert dw.batcher.stats.imported_tokens == 0 and dw.lost is None
    now[0] = 6.0
    r2 = Rig(dw, pw, td, tp)
    r2.pump()
    assert "key handshake" in (dw.lost or "") and dw.local_fallbacks == 1
    assert dw.summary()["errors_by_kind"] == {"peer_lost": 2}
    r2.exact(wids[2], 4)
    assert dw.batcher.stats.imported_tokens == 0


def test_prefill_worker_with_another_model_is_refused() -> None:
    r = rig(config(2), pseed=1)
    wids = [r.dw.submit(p, 4) for p in prompts(3)]
    r.pump()
    assert all("(fingerprint)" in (r.dw.results()[w].error or "") for w in wids)
    assert r.dw.payload_errors == {"fingerprint": 3}
    assert r.dw.batcher.stats.imported_tokens == 0
    settle(r)


# --------------------------------------------------------------------------- overlap
def test_decode_continues_while_an_import_is_in_flight() -> None:
    r = rig(config(2))
    a = r.dw.submit(list(range(20)), 40)
    r.pump(lambda: bool(r.dw.results()[a].tokens))  # a is imported and decoding
    r.to_decode.hold()  # b's KV will stay in flight
    b = r.dw.submit(list(range(30, 100)), 3)
    r.pump(lambda: r.pw.stats.exports == 2)
    steps = r.dw.batcher.stats.decode_steps
    overlapped = r.dw.overlapped_steps
    for _ in range(10):
        r.dw.step()
        r.pw.step_once()
    # b waits for its KV in a lane of its own while a kept decoding
    assert r.dw._importing(r.dw.requests[b].brid)
    assert r.dw.batcher.stats.decode_steps == steps + 10
    assert r.dw.overlapped_steps == overlapped + 10
    r.to_decode.release()
    r.pump()
    r.exact(a, 40)
    r.exact(b, 3)
    settle(r)


# --------------------------------------------------------------------------- payload faults
class Tamper:
    """The prefill worker's end of the link, rewriting the kv message for one wire id once
    (`fault(header, tensor)` returns the messages to send instead); records what it sent."""

    def __init__(self, inner: Any, target: str,
                 fault: Callable[[dict[str, Any], torch.Tensor], list[Any]]) -> None:
        self.inner, self.target, self.fault = inner, target, fault
        self.sent: list[tuple[dict[str, Any], Any]] = []
        self.fired = False

    def send(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        msgs = [(header, tensor)]
        if header.get("kind") == "kv" and header["request_id"] == self.target and \
                not self.fired:
            self.fired = True
            # the rewritten messages answer the same request (its nonce)
            msgs = [({**h, "nonce": header["nonce"]}, t)
                    for h, t in self.fault(header, tensor)]  # type: ignore[arg-type]
        for h, t in msgs:
            self.sent.append((h, t))
            self.inner.send(h, t)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _resend(payload: pd.KVPayload, key: bytes | None = KEY, *,
            sign: bool = True) -> list[Any]:
    """`payload` with a correct checksum (and mac under `key`), as the kv message."""
    p = attrs.evolve(payload, checksum="", mac=None)
    p = attrs.evolve(p, checksum=pd.compute_checksum(p),
                     mac=pd.compute_mac(p, derive_key(key, "payload mac")) if sign and key
                     else None)
    header, kv = pd.to_wire(p)
    return [({**header, "kind": "kv"}, kv)]


def truncate(h: dict[str, Any], t: torch.Tensor) -> list[Any]:
    p = pd.from_wire(h, t)  # a partial prefill: KV of all but the last position, signed
    return _resend(attrs.evolve(p, kv=p.kv[:, :, :, :-1].clone()))


def flip_byte(h: dict[str, Any], t: torch.Tensor) -> list[Any]:
    t = t.clone()
    t.reshape(-1).view(torch.uint8)[7] ^= 0x10
    return [(h, t)]


def other_key(h: dict[str, Any], t: torch.Tensor) -> list[Any]:
    return _resend(pd.from_wire(h, t), OTHER_KEY)


def unsigned(h: dict[str, Any], t: torch.Tensor) -> list[Any]:
    return _resend(pd.from_wire(h, t), sign=False)


def other_model(h: dict[str, Any], t: torch.Tensor) -> list[Any]:
    return _resend(attrs.evolve(pd.from_wire(h, t), fingerprint="f" * 64))


@pytest.mark.parametrize("fault,key,field", [
    (truncate, KEY, "length"), (flip_byte, None, "checksum"),
    (flip_byte, KEY, "mac"),  # with a key, any alteration is an authentication failure
    (other_key, KEY, "mac"), (unsigned, KEY, "mac"), (other_model, KEY, "fingerprint"),
], ids=["partial", "corrupt", "corrupt-keyed", "other-key", "unsigned", "fingerprint"])
def test_bad_payload_fails_only_its_request(fault: Callable[..., list[Any]],
                                            key: bytes | None, field: str) -> None:
    target = "1"
    r = rig(config(2), dkey=key, pkey=key, wrap=lambda t: Tamper(t, target, fault))
    wids = [r.dw.submit(p, 6) for p in prompts(5, seed=7)]
    r.pump()
    assert r.pw.transport.fired
    res = r.dw.results()
    err = res[int(target)].error
    assert err is not None and f"KV payload rejected ({field})" in err
    assert res[int(target)].tokens == []
    for w in wids:
        if w != int(target):
            r.exact(w, 6)
    assert r.dw.payload_errors == {field: 1}
    assert r.dw.auth_failures == (field == "mac")
    assert r.dw.summary()["errors_by_kind"] == {f"payload:{field}": 1}
    assert r.dw.batcher.stats.imported_tokens == sum(
        len(r.dw.requests[w].prompt) for w in wids if w != int(target))
    settle(r)
    serve_more(r)


def test_duplicate_late_and_unknown_kv_are_stale() -> None:
    r = rig(config(2), wrap=lambda t: Tamper(t, "0", lambda h, t: [(h, t), (h, t)]))
    wids = [r.dw.submit(p, 4) for p in prompts(3, seed=8)]
    r.pump()
    for w in wids:
        r.exact(w, 4)
    assert r.dw.stale_messages == 1  # the duplicate
    before = core.describe_state(r.dw.batcher.state)
    imported = r.dw.batcher.stats.imported_tokens
    kv_msgs = [m for m in r.pw.transport.sent if m[0]["kind"] == "kv"]
    r.to_decode.send(*kv_msgs[1])  # late: its request has finished
    r.to_decode.send({**kv_msgs[2][0], "request_id": "999"}, kv_msgs[2][1])  # unknown id
    r.to_decode.send({"kind": "prefill_failed", "id": "2", "error": "late",
                      "nonce": r.dw.requests[2].nonce})
    # an answer naming request 2 with request 1's nonce is not request 2's
    r.to_decode.send({"kind": "prefill_failed", "id": "2", "error": "misdirected",
                      "nonce": r.dw.requests[1].nonce})
    r.to_decode.send({"kind": "what"})
    r.dw.step()
    assert r.dw.stale_messages == 5 and r.dw.misdirected == 1
    assert core.describe_state(r.dw.batcher.state) == before
    assert r.dw.batcher.stats.imported_tokens == imported
    assert all(r.dw.results()[w].error is None for w in wids)
    settle(r)
    serve_more(r)


def test_prefill_side_failure_is_reported_not_waited_for() -> None:
    # The prefill worker's artifact is shorter: it refuses a prompt the decode side accepts.
    r = rig(config(2), config(1, max_seq_len=C))
    long, short = [5] * 100, [6] * 10
    a, b = r.dw.submit(long, 3), r.dw.submit(short, 3)
    r.pump()
    err = r.dw.results()[a].error
    assert err is not None and "prefill worker refused" in err and "max_seq_len" in err
    assert r.dw.summary()["errors_by_kind"] == {"prefill_failed": 1}
    r.exact(b, 3)
    settle(r)


def test_lost_kv_times_out_and_frees_the_lane() -> None:
    now = [0.0]  # the decode worker's clock: a loaded machine cannot time the others out
    r = rig(config(2), transfer_timeout=0.05, clock=lambda: now[0])
    r.to_decode.drop_next(1)  # the first kv message vanishes
    wids = [r.dw.submit(p, 3) for p in prompts(3, seed=9)]
    r.pump(lambda: r.pw.stats.exports == 3)
    now[0] = 0.06
    r.pump()
    res = r.dw.results()
    assert "did not answer within 0.05s" in (res[0].error or "")
    assert r.dw.summary()["errors_by_kind"] == {"timeout": 1}
    for w in wids[1:]:
        r.exact(w, 3)
    settle(r)


# --------------------------------------------------------------------------- aborts
def test_abort_during_import_drains_until_the_kv_arrives() -> None:
    r = rig(config(2))
    a, b = (r.dw.submit(p, 4) for p in prompts(2, seed=10))
    r.dw.step()  # both admitted as imports, prefill requests sent
    r.to_decode.hold()
    r.pump(lambda: r.pw.stats.exports == 2)  # both KVs in flight
    bb = r.dw.requests[b].brid
    block = r.dw.batcher.transfers()[bb]
    assert r.dw.abort(b)
    assert not r.dw.abort(b)
    assert core.describe_state(r.dw.batcher.state)["owner"][block] == "DRAINING"
    r.pw.step_once()  # the cancel: too late, its KV is on the way
    assert r.pw.stats.cancelled == 0 and r.pw.stats.ignored == 1
    r.to_decode.release()
    r.pump()
    r.exact(a, 4)
    assert r.dw.results()[b].error == "aborted"
    assert r.dw.drained == 1 and r.dw.stale_messages == 0
    assert r.dw.batcher.stats.imported_tokens == len(r.dw.requests[a].prompt)
    assert r.dw.summary()["errors_by_kind"] == {"aborted": 1}
    settle(r)
    serve_more(r)


def test_abort_before_prefill_cancels_it_on_the_prefill_side() -> None:
    r = rig(config(2))
    a, b = (r.dw.submit(p, 4) for p in prompts(2, seed=11))
    r.dw.step()
    assert r.dw.abort(b)  # its prefill request and the cancel arrive together
    r.pump()
    assert r.pw.stats.cancelled == 1 and r.pw.stats.exports == 1
    assert r.dw.drained == 1  # the cancel's answer freed the draining block
    r.exact(a, 4)
    settle(r)
    serve_more(r)


# --------------------------------------------------------------------------- lost peer
@pytest.mark.parametrize("fallback", [True, False])
def test_prefill_worker_killed_mid_transfer(fallback: bool) -> None:
    r = rig(config(2), fallback_local=fallback)
    ps = prompts(6, seed=12)
    wids = [r.dw.submit(p, 5) for p in ps]
    r.pump(lambda: r.dw.batcher.stats.imported_tokens > 0)
    r.to_decode.hold()
    exports = r.pw.stats.exports
    r.pump(lambda: r.pw.stats.exports > exports)  # a KV is in flight...
    r.to_decode.kill()  # ...and dies with its worker
    r.pump()
    res = r.dw.results()
    lost = [w for w in wids if "prefill worker lost" in (res[w].error or "")]
    assert lost and all("peer was killed" in (res[w].error or "") for w in lost)
    served = [w for w in wids if w not in lost]
    for w in served:
        r.exact(w, 5)
    if fallback:  # every request not sent to the prefill worker was prefilled here
        local = [w for w in served if r.dw.requests[w].wire is None]
        assert local and r.dw.local_fallbacks == len(local)
    else:
        assert r.dw.local_fallbacks == 0
        assert any("no local fallback" in (res[w].error or "") for w in lost)
    assert_clean(r.dw)
    # New requests: served by local prefill, or failed at once and clearly.
    w = r.dw.submit(ps[0], 4)
    r.pump()
    if fallback:
        r.exact(w, 4)
    else:
        assert "no local fallback" in (r.dw.results()[w].error or "")
    assert_clean(r.dw)


# --------------------------------------------------------------------------- prefetch
def test_prefetched_kv_waits_for_a_lane_and_bad_prefetches_fail_alone() -> None:
    # 2 lanes, prefetch 2: requests 2 and 3 are asked for before they hold anything.
    r = rig(config(2), prefetch=2, wrap=lambda t: Tamper(t, "3", flip_byte))
    wids = [r.dw.submit(p, 6) for p in prompts(6, seed=15)]
    r.dw.step()
    assert [r.dw.requests[w].wire for w in wids] == ["0", "1", "2", "3", None, None]
    r.pump(lambda: r.dw.requests[2].payload is not None)
    assert r.dw.batcher.state.phase.get(r.dw.requests[2].brid) == core.PHASE_WAITING
    r.pump()
    err = r.dw.results()[3].error
    assert err is not None and "(checksum)" in err
    for w in wids:
        if w != 3:
            r.exact(w, 6)
    assert r.dw.batcher.stats.imported_tokens == sum(
        len(r.dw.requests[w].prompt) for w in wids if w != 3)
    assert r.dw.batcher.stats.transfer_failures == 0  # 3 never held a lane or a block
    assert r.dw.summary()["errors_by_kind"] == {"payload:checksum": 1}
    settle(r)


def test_abort_of_a_prefetched_request_cancels_it() -> None:
    r = rig(config(1), prefetch=2)
    for p in prompts(3, seed=16):
        r.dw.submit(p, 4)
    r.dw.step()
    assert r.dw.requests[1].wire == "1"
    assert r.dw.abort(1)
    r.pump()
    r.exact(0, 4)
    r.exact(2, 4)
    assert r.dw.results()[1].error == "aborted" and r.dw.results()[1].tokens == []
    assert r.pw.stats.cancelled + r.pw.stats.exports == 3
    assert r.dw.drained == 0  # a waiting request holds no block
    settle(r)


def test_prefetched_kv_survives_the_prefill_workers_loss() -> None:
    r = rig(config(2), prefetch=2)
    ps = prompts(6, seed=17)
    wids = [r.dw.submit(p, 5) for p in ps]
    # some request's KV is buffered (prefetched: it arrived before the request's lane did)
    r.pump(lambda: any(r.dw.requests[w].payload is not None for w in wids))
    buffered = [w for w in wids if r.dw.requests[w].payload is not None]
    r.to_decode.kill()
    r.pump()
    res = r.dw.results()
    lost = [w for w in wids if res[w].error is not None]
    assert all("prefill worker lost" in (res[w].error or "") for w in lost)
    for w in wids:
        if w not in lost:
            r.exact(w, 5)
    remote = [w for w in wids if w not in lost
              and r.dw.batcher.requests[r.dw.requests[w].brid].remote]
    assert buffered and set(buffered) <= set(remote)  # buffered before the loss, imported after
    assert r.dw.batcher.stats.imported_tokens == sum(len(ps[w]) for w in remote)
    assert r.dw.local_fallbacks == len(wids) - len(lost) - len(remote) > 0
    assert_clean(r.dw)


# --------------------------------------------------------------------------- two processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


GLOO_CFG = ["--lanes", "2", "--max-seq-len", str(S), "--prefill-chunk", str(C)]


@pytest.fixture
def prefill_proc() -> Iterator[Callable[..., tuple[subprocess.Popen[str], int]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(argv: list[str] | None = None, script: str | None = None
              ) -> tuple[subprocess.Popen[str], int]:
        port = _free_port()
        cmd = [sys.executable, "-c", script, str(port)] if script else \
            [sys.executable, "-m", "atom_core.cli", "pd-prefill", "--port", str(port),
             *(argv or [])]
        env = {**os.environ, "ATOM_CORE_PD_KEY": KEY.decode()}
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        procs.append(p)
        return p, port

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=10)


@pytest.mark.parametrize("paged", [False, True], ids=["one-block", "paged"])
def test_gloo_two_processes_equal_the_oracle(prefill_proc: Any, paged: bool) -> None:
    """Paged: the prefill process's tables are two blocks of 64 (`--block-size`), the decode
    side's are one block of 128: multi-block exports travel as positions."""
    extra = ["--block-size", str(C)] if paged else []
    proc, port = prefill_proc([*GLOO_CFG, *extra, "--prefix-cache", "--json"])  # key: the env
    cfg = config(2)
    rt = TorchReferenceRuntime.tiny(cfg)
    transport = GlooTransport(0, port=port, timeout=20.0)
    ps = prompts(8, seed=13)
    with DecodeWorker(cfg, rt, transport, key=KEY, prefetch=2) as dw:
        wids = [dw.submit(p, 6) for p in ps]
        res = dw.run_until_done(timeout=20.0)
        assert_clean(dw)
        s = dw.summary()
    oracle = oracle_for(rt)
    for w, p in zip(wids, ps, strict=True):
        assert res[w].error is None and res[w].tokens == oracle.generate(p, 6)
    assert s["imported_tokens"] == sum(map(len, ps)) and s["auth_failures"] == 0
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["exports"] == 8 and stats["ended_by"] == "shutdown"


SLOW_PREFILL = f"""
import sys, time
from atom_core.config import Config
from atom_core.runtime.reference import TorchReferenceRuntime
from atom_core.pd.transport import GlooTransport
from atom_core.pd.workers import PrefillWorker


class Slow:  # each prefill chunk takes 0.25 s: the kill lands while one is in flight
    def __init__(self, rt):
        self._rt = rt

    def __getattr__(self, name):
        return getattr(self._rt, name)

    def prefill(self, *args):
        time.sleep(0.25)
        return self._rt.prefill(*args)


cfg = Config(lanes=2, kv_blocks=3, max_seq_len={S}, prefill_chunk={C})
t = GlooTransport(1, port=int(sys.argv[1]), timeout=20.0)
PrefillWorker(cfg, Slow(TorchReferenceRuntime.tiny(cfg)), t, key={KEY!r}).serve()
"""


def test_gloo_prefill_process_killed_mid_transfer(prefill_proc: Any) -> None:
    # (no wall-clock bound on the whole test: a shared machine makes one flaky; the loss must
    # be seen within run_until_done's timeout, far below the transport's own 20 s)
    proc, port = prefill_proc(script=SLOW_PREFILL)
    cfg = config(2)
    rt = TorchReferenceRuntime.tiny(cfg)
    transport = GlooTransport(0, port=port, timeout=20.0)
    ps = prompts(6, seed=14, hi=60)  # one chunk each
    with DecodeWorker(cfg, rt, transport, key=KEY) as dw:
        wids = [dw.submit(p, 8) for p in ps]
        deadline = time.monotonic() + 10.0
        while dw.batcher.stats.imported_tokens == 0:
            assert time.monotonic() < deadline
            dw.step()
            transport.wait(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # request 1's prefill is mid-way
        res = dw.run_until_done(timeout=10.0)
        assert dw.lost is not None
        # 1 was in flight; so is any request admitted (and sent) before the loss was seen
        lost = [w for w in wids if "prefill worker lost" in (res[w].error or "")]
        assert 1 in lost and 0 not in lost
        assert dw.summary()["errors_by_kind"] == {"peer_lost": len(lost)}
        oracle = oracle_for(rt)
        for w, p in zip(wids, ps, strict=True):
            if w not in lost:
                assert res[w].error is None and res[w].tokens == oracle.generate(p, 8)
        assert dw.local_fallbacks == len(wids) - 1 - len(lost) > 0  # 0 was imported
        assert_clean(dw)
        extra = dw.submit(ps[1], 3)  # still serving: local prefill
        assert dw.run_until_done(timeout=10.0)[extra].tokens == oracle.generate(ps[1], 3)
        assert_clean(dw)


# --------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("argv,message", [
    (["pd-decode", "--lanes", "4", "--kv-blocks", "3", "--prefix-cache"],
     "kv_blocks >= lanes"),
    (["pd-prefill", "--lanes", "2", "--kv-blocks", "2", "--scratch", "reserved"],
     "kv_blocks >= lanes + 1"),
    (["pd-prefill", "--prefill-chunk", "96"], "multiple of 64"),
    (["pd-prefill", "--max-seq-len", "32"], "prefill_chunk must not exceed block_size"),
    (["pd-decode", "--block-size", "96"], "not a multiple of --block-size 96"),
    (["pd-decode", "--max-seq-len", "768", "--block-size", "384", "--prefill-chunk", "256"],
     "must be a multiple of prefill_chunk"),
    (["pd-decode", "--key", "short"], "at least 16"),
    (["pd-prefill", "--key", "env:ATOM_CORE_PD_TEST_UNSET"], "is not set"),
    (["pd-prefill", "--runtime", "rbln"], "PD does not support --runtime rbln"),
    (["pd-decode", "--runtime", "rbln", "--compiled", ".", "--insecure"],
     "PD does not support --runtime rbln"),
    # a key is required, loopback included
    (["pd-decode"], "no PD key"),
    (["pd-prefill", "--host", "127.0.0.1"], "loopback included"),
    (["pd-decode", "--key", ""], "--key is empty"),
    (["pd-prefill", "--key", KEY.decode(), "--insecure"], "exclude each other"),
    (["pd-decode", "--insecure", "--link-label", "pair-a"], "--link-label names a keyed link"),
    (["pd-prefill", "--key", KEY.decode(), "--link-label", "a\tb"],
     "--link-label must be printable"),
    # values the options' types refuse (atom_core.options), before anything connects
    (["pd-decode", "--insecure", "--timeout", "nan"], "argument --timeout: must be seconds > 0"),
    (["pd-decode", "--insecure", "--timeout", "inf"], "argument --timeout: must be seconds > 0"),
    (["pd-prefill", "--insecure", "--timeout", "0"], "argument --timeout: must be seconds > 0"),
    (["pd-decode", "--insecure", "--transfer-timeout", "-1"],
     "argument --transfer-timeout: must be seconds > 0"),
    (["pd-decode", "--insecure", "--transfer-timeout", "inf"],
     "argument --transfer-timeout: must be seconds > 0"),
    (["pd-decode", "--insecure", "--prefetch", "-1"],
     "argument --prefetch: must be an integer in 0..32768"),
])
def test_cli_argument_errors_exit_2(capsys: Any, monkeypatch: Any, argv: list[str],
                                    message: str) -> None:
    """Exit code 2 and one line on stderr, before any connection is tried (the port is free:
    nothing would answer, so a connection attempt would fail differently and later)."""
    monkeypatch.delenv("ATOM_CORE_PD_KEY", raising=False)
    extra = ["--port", str(_free_port())] + ([] if "--timeout" in argv else ["--timeout", "1"])
    try:
        code = cli.main([*argv, *extra])
    except SystemExit as exc:  # an option's type refused it: a usage error, as argparse's
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err


def test_cli_key_file_readable_by_others_is_refused(capsys: Any, monkeypatch: Any,
                                                   tmp_path: Path) -> None:
    monkeypatch.delenv("ATOM_CORE_PD_KEY", raising=False)
    f = tmp_path / "pd.key"
    f.write_text(KEY.decode())
    f.chmod(0o644)
    assert cli.main(["pd-prefill", "--key", f"file:{f}", "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert "chmod 600" in err and KEY.decode() not in err


def test_workers_need_a_key_unless_insecure() -> None:
    cfg = config(1)
    rt = TorchReferenceRuntime.tiny(cfg)
    td, tp = InProcessTransport.pair()
    for make in (lambda **k: PrefillWorker(cfg, rt, tp, **k),
                 lambda **k: DecodeWorker(cfg, rt, td, **k)):
        with pytest.raises(ValueError, match="loopback too"):
            make()
        with pytest.raises(ValueError, match="at least 16"):
            make(key=b"short")
        make(insecure=True)
    for bad in (None, float("inf"), float("nan"), 0, -1.0):
        with pytest.raises(ValueError, match="transfer_timeout must be finite positive"):
            DecodeWorker(cfg, rt, td, insecure=True, transfer_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefetch"):
        DecodeWorker(cfg, rt, td, insecure=True, prefetch=-1)


def test_cli_pd_demo_small(capsys: Any) -> None:
    code = cli.main(["pd-demo", "--lanes", "2", "--requests", "4", "--max-new-tokens", "3",
                     "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert set(out) == {"pd_on_demand", "pd_prefetch", "colocated"}
    assert all(run["exact"] for run in out.values())
    for mode, prefetch in (("pd_on_demand", 0), ("pd_prefetch", 2)):
        run = out[mode]
        assert run["prefetch"] == prefetch and run["completed"] == 4
        assert run["prefill_worker"]["exports"] == 4 and run["prefill_exit_code"] == 0
        assert run["bytes_received"] > 0 and run["auth_failures"] == 0


def test_cli_workers_with_different_keys_refuse_each_other(prefill_proc: Any,
                                                          capsys: Any) -> None:
    """pd-prefill with the test key (its environment), pd-decode with another: the decode side
    refuses the handshake (exit 1, one clear line), the prefill side sees the peer leave."""
    proc, port = prefill_proc([*GLOO_CFG, "--timeout", "20"])
    code = cli.main(["pd-decode", *GLOO_CFG, "--port", str(port), "--timeout", "20",
                     "--key", OTHER_KEY.decode(), "--requests", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "PD link refused" in err and "failed the key challenge" in err, err
    out, perr = proc.communicate(timeout=20)
    assert proc.returncode == 1 and "PD link refused" in perr and "handshake" in perr, perr


# --------------------------------------------------------------------------- long-running
def test_a_long_running_decode_worker_keeps_a_bounded_number_of_results() -> None:
    """keep_ended=K: results and the batcher's and core's records cover the last K ended
    requests; memory does not grow with the requests served; streamed tokens stay exact; a
    late answer for a forgotten request is stale, not an error."""
    r = rig(config(2), config(2, prefix=True))
    r.dw.keep_ended = 3
    oracle = oracle_for(r.dw.runtime)
    streamed: dict[int, list[int]] = {}
    work = prompts(12, 7)
    wids = []
    for i, p in enumerate(work):
        wids.append(r.dw.submit(p, 4))
        if i == 5:
            r.dw.abort(wids[-1])  # an abort mid-flight: its blocks drain first
        for _ in range(4):
            for ev in r.dw.step():
                if ev.kind == "token":
                    streamed.setdefault(ev.request_id, []).append(ev.token)
            r.pw.step_once()
        assert len(r.dw.requests) <= 3 + 2 + len(r.dw.batcher.waiting) + len(r.dw._by_wire)
    while r.dw.busy() or r.pw.batcher.busy():
        for ev in r.dw.step():
            if ev.kind == "token":
                streamed.setdefault(ev.request_id, []).append(ev.token)
        r.pw.step_once()
    assert len(r.dw.requests) == 3 and len(r.dw.results()) == 3
    assert len(r.dw.batcher.requests) == 3 and len(r.dw.batcher.state.prompt) == 3
    assert r.dw.batcher.stats.forgotten == len(work) - 3
    for i, wid in enumerate(wids):
        if i != 5:
            assert streamed[wid] == oracle.generate(work[i], 4), i
    assert r.dw.summary()["requests"] == 3
    assert_clean(r.dw)
