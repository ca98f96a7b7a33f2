"""The request lifecycle of `atom-core serve` against bugs public serving engines have had, each
through a live server (tests/test_serve.py's `Server`, or the CLI in a subprocess for signals)
and the real `openai` client, or a raw socket where a client must misbehave in a way the client
cannot (stop reading, leave before its first token): whatever a client does, its request ends
exactly once, its lane and blocks come back, and no other client is held up.

Fixed here: a stream whose client stopped reading kept its in-flight place for good (one such
client filled a one-lane server: everyone else got 429); a BaseException out of a step (a
SystemExit out of a runtime call) stopped the engine without ending its requests (each hung
until its timeout); a request submitted just as the engine stopped was never answered; on
SIGTERM, requests still running at the drain timeout had their handlers cancelled (a bare
"Internal Server Error", a stream cut mid-body). Shown sound: disconnects at every point of a
request's life, aborts at every point and racing the engine's steps, a bounded FCFS queue, an
end token or stop at the very last token, and /state and /metrics after all of it."""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_serve import KEY, MODEL, Server, SlowRuntime, tiny_config  # noqa: E402

from atom_core._generated import core  # noqa: E402
from atom_core.batcher import AtomBatcher, Event  # noqa: E402
from atom_core.config import Config, min_kv_blocks  # noqa: E402
from atom_core.serve.engine import Engine, Handle  # noqa: E402
from atom_core.serve.tokenizer import ByteTokenizer  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = "never stop talking"  # its greedy reply has no end token: 230 tokens unless aborted


def until(cond: Callable[[], Any], timeout: float = 10.0, what: str = "",
          progress: Callable[[], Any] | None = None) -> Any:
    """Poll `cond` until it is true (returned) or `timeout` passes (a failure). `progress`: a
    measure of the awaited work (tokens generated) that moves while it advances; the deadline
    then counts from its last move, so a loaded machine, slow but advancing, never fails the
    wait, while a stall still fails it after `timeout`."""
    deadline = time.monotonic() + timeout
    last = None if progress is None else progress()
    while True:
        got = cond()
        if got:
            return got
        if progress is not None and (now := progress()) != last:
            last, deadline = now, time.monotonic() + timeout
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}" + (
            "" if progress is None else f" (no progress for {timeout:g}s, at {last})")
        time.sleep(0.02)


def open_stream(base: str, body: dict[str, Any], rcvbuf: int | None = None) -> socket.socket:
    """POST a completion on a raw socket and return it unread (a client that reads when, and
    if, it likes); `rcvbuf`: a small receive buffer, so the server soon has to wait for it."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                 .encode() + data)
    return sock


def outcomes(s: Server) -> dict[str, float]:
    text = httpx.get(s.base + "/metrics", headers=AUTH).text
    return {smp.labels["outcome"]: smp.value for f in text_string_to_metric_families(text)
            for smp in f.samples if smp.name == "atom_requests_total"}


def metric_values(s: Server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(s.base + "/metrics", headers=AUTH).text
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for f in text_string_to_metric_families(text) for smp in f.samples}


def at_rest(s: Server) -> dict[str, Any]:
    """The server once nothing is in flight, checked: no block owned by a lane (or pinned for a
    transfer), the batcher's invariants hold."""
    st = s.wait_at_rest()
    assert all(own in ("free", "cache") for own in st["blocks"]), st["blocks"]
    owners = s.engine.call(lambda b: (b.check_invariants(), set(b.state.owner))[1])
    assert not {core.OWNER_LANE, core.OWNER_DRAINING, core.OWNER_SPILLING} & owners
    return st


def running(s: Server) -> list[int]:
    return [ln["request"] for ln in s.state()["lanes"] if ln["request"] is not None]


# ------------------------------------------------------------------ slow readers (fixed)
class Wide(ByteTokenizer):
    """Each character decodes 10,000 times over: a 230-token stream is 6.8 MB of SSE, more than
    the loopback socket buffers hold (4 MB at most here), so a client that does not read makes
    the server wait on it."""

    def decode(self, ids: Any) -> str:
        return "".join(c * 10_000 for c in super().decode(ids))


def test_a_client_that_stops_reading_holds_no_place_once_its_request_ended() -> None:
    """Bug: a stream's in-flight place (what the 429 limit counts) came back only when its
    client read the end. A client that stops reading (or reads slowly) stalls its stream at a
    write, long after the batcher finished it: one such client kept a one-lane server answering
    429 to everyone (with the default queue, 68 of them did) (--request-timeout now ends such a
    write too: tests/test_serve_edge_audit.py). Now the place comes back when the batcher ends
    the request. Memory stays bounded meanwhile (the request's own tokens: its generation
    ended), other streams flow, and the slow client still gets every byte when it does read."""
    with Server(tiny_config(lanes=1), tokenizer=Wide(), max_queue=0) as s:
        slow = open_stream(s.base, {"model": MODEL, "prompt": LONG, "max_tokens": 230,
                                    "temperature": 0, "stream": True}, rcvbuf=4096)
        try:
            # the batcher finished it (its lane is free) while its client read nothing: 230
            # tokens of 10,000 characters each to escape and frame, which a loaded machine
            # takes well over 10 s to get through, so the wait runs while tokens still come
            until(lambda: s.state()["stats"]["generated_tokens"] == 230 and not running(s),
                  what="the slow stream's generation to end",
                  progress=lambda: s.state()["stats"]["generated_tokens"])
            assert s.state()["in_flight"] == 0
            # the server serves others: no 429, no stall
            c = s.client()
            res = c.completions.create(model=MODEL, prompt="next", max_tokens=4, temperature=0)
            assert res.usage.completion_tokens == 4
            chunks = list(c.completions.create(model=MODEL, prompt="next", max_tokens=4,
                                               temperature=0, stream=True))
            assert [ch.choices[0].finish_reason for ch in chunks][-1] in ("stop", "length")
            # the slow client reads at last: the whole stream, ending as it should
            raw = bytearray()
            slow.settimeout(10)
            while not raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # (chunked)
                part = slow.recv(1 << 20)
                assert part, "the server closed the slow stream"
                raw += part
            body = bytes(raw).split(b"\r\n\r\n", 1)[1]
            frames = [ln for ln in body.split(b"\n") if ln.startswith(b"data: {")]
            last = json.loads(frames[-1][len(b"data: "):])
            assert last["choices"][0]["finish_reason"] == "length"
        finally:
            slow.close()
        at_rest(s)
        assert outcomes(s)["rejected"] == 0


# ------------------------------------------------------------------ engine failure (fixed)
class Boom(BaseException):
    """Not an Exception: as SystemExit or KeyboardInterrupt out of a runtime's call."""


class Failing(SlowRuntime):
    """Decode raises `fail` (once set)."""

    fail: BaseException | None = None

    def decode(self, *args, **kwargs):
        if self.fail is not None:
            raise self.fail
        return super().decode(*args, **kwargs)


class BuggyBatcher(AtomBatcher):
    """A batcher whose `step` raises (a bug of the batcher's or the core's own)."""

    bug = False

    def step(self) -> list[Event]:
        if self.bug:
            raise RuntimeError("batcher bug")
        return super().step()


def long_completions(base: str, calls: tuple[tuple[str, bool], ...], timeout: float
                     ) -> tuple[dict[str, Any], list[threading.Thread]]:
    """Start one 200-token completion of LONG per (name, stream), 50 ms apart (so they queue in
    that order), each in its own thread; `results[name]` is then the response (a stream's
    chunks) or the openai.APIError it raised."""
    results: dict[str, Any] = {}

    def call(name: str, stream: bool) -> None:
        c = openai.OpenAI(api_key=KEY, base_url=base + "/v1", max_retries=0, timeout=timeout)
        try:
            res = c.completions.create(model=MODEL, prompt=LONG, max_tokens=200,
                                       temperature=0, stream=stream)
            results[name] = list(res) if stream else res
        except openai.APIError as exc:
            results[name] = exc

    threads = [threading.Thread(target=call, args=call_args) for call_args in calls]
    for t in threads:
        t.start()
        time.sleep(0.05)
    return results, threads


@pytest.mark.parametrize("where", ["runtime-base-exception", "batcher-exception"])
def test_an_engine_that_stops_ends_every_request_with_one_clear_error(where: str) -> None:
    """Bug: the engine loop caught Exception only; a BaseException out of a step (the batcher
    re-raises a SystemExit or KeyboardInterrupt out of a runtime call, after failing that
    call's requests) stopped the thread with every request in flight left without an end: each
    waited out its --request-timeout (600 s by default), /health said only "stopped". Now each
    in-flight request, streamed or not, running or queued, gets one error at once, /health is a
    503 with the reason, and a new request is a 503."""
    s = Server(tiny_config(lanes=1), delay=0.01, request_timeout=60)
    rt = Failing.tiny(s.cfg, seed=0, vocab_size=s.tok.vocab_size)
    rt.delay = 0.01
    s.runtime = rt
    s.engine.batcher = (BuggyBatcher if where == "batcher-exception" else AtomBatcher)(s.cfg, rt)
    with s:
        results, threads = long_completions(s.base, (("plain", False), ("stream", True),
                                                      ("queued-plain", False),
                                                      ("queued-stream", True)), timeout=20)
        until(lambda: s.state()["in_flight"] == 4 and len(s.state()["waiting"]) == 3,
              what="one request running and three queued")
        t0 = time.monotonic()
        if where == "batcher-exception":
            s.engine.batcher.bug = True
        else:
            rt.fail = Boom("runtime called exit")
        for t in threads:
            t.join(15)
        assert time.monotonic() - t0 < 10  # (before the fix: each waited for its timeout)
        assert set(results) == {"plain", "stream", "queued-plain", "queued-stream"}
        for name, got in results.items():
            assert isinstance(got, openai.APIError), (name, got)
            assert "engine stopped" in got.message or "failed" in got.message, (name, got)
        h = httpx.get(s.base + "/health")
        assert h.status_code == 503 and "engine stopped" in h.json()["reason"]
        assert ("Boom" if where != "batcher-exception" else "batcher bug") in h.json()["reason"]
        with pytest.raises(openai.APIStatusError) as exc:
            s.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert exc.value.status_code == 503 and exc.value.body["code"] == "engine_down"
        st = s.state()
        assert st["in_flight"] == 0 and st["engine_running"] is False
        got = outcomes(s)
        assert got["error"] == 4 and got["rejected"] == 1, got


# ------------------------------------------------------------------ engine end races (fixed)
class RacingQueue:
    """The engine's command queue, with the engine made to stop between a client's check that
    it runs and that client's command reaching the queue: the client's command is put only
    after a stop command (and a moment for the thread to end)."""

    def __init__(self, engine: Engine, kind: str) -> None:
        self.q: queue.SimpleQueue[Any] = engine._cmds
        self.engine, self.kind, self.raced = engine, kind, False

    def put(self, cmd: Any) -> None:
        if cmd[0] == self.kind and not self.raced:
            self.raced = True
            self.q.put(("stop", None))
            self.engine._thread.join(1.0)  # (ends, unless it must wait for this put)
        self.q.put(cmd)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self.q.get(*args, **kwargs)

    def get_nowait(self) -> Any:
        return self.q.get_nowait()


def test_a_request_submitted_as_the_engine_stops_is_answered() -> None:
    """Bug: `submit` checked that the engine ran, then queued its command; the engine could
    stop and drain its queue in between, and the command was never read: the request hung until
    its --request-timeout. The same for `call` (/metrics, /state): a 10 s wait, then a 500."""
    with Server(tiny_config(), request_timeout=60) as s:
        s.engine._cmds = RacingQueue(s.engine, "submit")  # type: ignore[assignment]
        c = openai.OpenAI(api_key=KEY, base_url=s.base + "/v1", max_retries=0, timeout=8)
        with pytest.raises(openai.APIStatusError) as exc:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
        assert "shutting down" in exc.value.message
        assert s.state()["in_flight"] == 0
    # a call (a scrape) racing the engine's end, on the engine alone
    cfg = tiny_config()
    engine = Engine(AtomBatcher(cfg, SlowRuntime.tiny(cfg, seed=0)))
    engine.start()
    engine._cmds = RacingQueue(engine, "call")  # type: ignore[assignment]
    t0 = time.monotonic()
    assert engine.call(lambda b: len(b.waiting), timeout=5) == 0
    assert time.monotonic() - t0 < 4 and not engine.running
    # a call that raises after the engine ended hands its error to the caller
    engine2 = Engine(AtomBatcher(cfg, SlowRuntime.tiny(cfg, seed=0)))
    engine2.start()
    engine2._cmds = RacingQueue(engine2, "call")  # type: ignore[assignment]
    with pytest.raises(ZeroDivisionError):
        engine2.call(lambda b: 1 // 0, timeout=5)


# ------------------------------------------------------------------ SIGTERM drain (fixed)
SLOW_SERVE = """
import sys, time
from atom_core.serve import runtimes
from atom_core.runtime.reference import TorchReferenceRuntime

class Slow(TorchReferenceRuntime):
    def decode(self, *args, **kwargs):
        time.sleep(0.02)
        return super().decode(*args, **kwargs)

def slow(opts):
    cfg, rt, tok = runtimes._reference(opts)
    rt.__class__ = Slow
    return cfg, rt, tok

runtimes.register_runtime("slow", slow)
from atom_core.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_past_the_drain_timeout_gives_each_request_a_clear_error() -> None:
    """Bug: on SIGTERM, requests still running when --drain-timeout passed had their handlers
    cancelled by uvicorn: a request without stream got a bare text/plain "Internal Server
    Error" (not the API's error shape), a stream was cut mid-body (no error event, no [DONE]:
    the client saw a connection error), and a queued request the same. Now the engine ends them
    at the drain timeout, while their handlers run: each gets the API's error saying the server
    is shutting down, and the process exits 0."""
    env = {**os.environ, "ATOM_CORE_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVE, "serve", "--runtime", "slow",
                             "--port", "0", "--lanes", "1", "--drain-timeout", "1",
                             "--log-level", "info"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        assert proc.stderr is not None
        for line in proc.stderr:
            if m := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
                break
        assert port, "no port printed"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # (keep the pipe empty)
        base = f"http://127.0.0.1:{port}"
        results, threads = long_completions(
            base, (("plain", False), ("stream", True), ("queued", False)), timeout=30)

        def state() -> dict[str, Any]:
            return httpx.get(base + "/state", headers=AUTH).json()

        # 200 tokens at 20 ms each: none can finish within the 1 s drain
        until(lambda: state()["in_flight"] == 3 and state()["stats"]["generated_tokens"] > 0,
              what="three requests in flight")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(20)
        assert proc.wait(20) == 0
        assert time.monotonic() - t0 < 8
        assert set(results) == {"plain", "stream", "queued"}
        for name in ("plain", "queued"):
            err = results[name]
            assert isinstance(err, openai.InternalServerError), (name, err)
            assert err.response.headers["content-type"] == "application/json"
            assert "shutting down" in err.body["message"], (name, err.body)
        err = results["stream"]
        assert isinstance(err, openai.APIError) and not isinstance(err, openai.APIConnectionError)
        assert "shutting down" in err.message
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------ disconnects (sound)
def test_clients_leaving_before_their_first_token_are_aborted_at_once() -> None:
    """A stream and a plain request, queued behind a long one on a one-lane server, whose
    clients leave before they got anything: both leave the batcher's queue at once (a stream at
    the disconnect, a plain request within its 0.25 s poll), never run, are counted once as
    aborted, and the running request goes on to its exact end."""
    with Server(tiny_config(lanes=1), delay=0.01) as s:
        want = s.oracle(s.tok.encode(LONG), 150)
        got: list[int] = []

        def first() -> None:
            stream = s.client().completions.create(
                model=MODEL, prompt=LONG, max_tokens=150, temperature=0, stream=True,
                extra_body={"return_token_ids": True})
            got.extend(t for ch in stream for t in ch.choices[0].token_ids)

        t = threading.Thread(target=first)
        t.start()
        until(lambda: running(s), what="the first request to run")
        gone = open_stream(s.base, {"model": MODEL, "prompt": "left", "max_tokens": 5,
                                    "temperature": 0, "stream": True})
        until(lambda: len(s.state()["waiting"]) == 1, what="the stream to queue")
        gone.close()
        until(lambda: not s.state()["waiting"], timeout=2, what="the stream to leave the queue")

        def plain() -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.base + "/v1/completions", headers=AUTH, timeout=0.4,
                           json={"model": MODEL, "prompt": "left too", "max_tokens": 5})

        p = threading.Thread(target=plain)
        p.start()
        until(lambda: len(s.state()["waiting"]) == 1, what="the plain request to queue")
        p.join(5)
        until(lambda: not s.state()["waiting"], timeout=2, what="it to leave the queue")
        assert running(s)  # the first one still runs
        t.join(20)
        assert got == want
        at_rest(s)
        assert s.engine.call(lambda b: [len(r.tokens) for r in b.requests.values()]) == \
            [150, 0, 0]
        got_out = outcomes(s)
        assert got_out["aborted"] == 2 and got_out["length"] + got_out["stop"] == 1, got_out


# ------------------------------------------------------------------ aborts (sound)
def engine_with(cfg: Config, runtime: Any, **kw: Any) -> tuple[Engine, dict[int, list[Event]]]:
    """An engine over a real batcher, each handle's events recorded by the handle's index."""
    engine = Engine(AtomBatcher(cfg, runtime, **kw), idle_wait=0.01)
    return engine, {}


def handle(events: dict[int, list[Event]], i: int, prompt: list[int], n: int) -> Handle:
    events[i] = []
    return Handle(prompt, n, None, None, sink=events[i].append)


def final(evs: list[Event]) -> list[str]:
    return [e.kind for e in evs if e.kind in ("finished", "error", "aborted")]


class SlowPrefill(SlowRuntime):
    def prefill(self, *args, **kwargs):
        time.sleep(0.05)
        return super().prefill(*args, **kwargs)


def test_an_abort_at_every_point_of_a_request_ends_it_once() -> None:
    """Abort while waiting, while prefilling (a 4-chunk prompt), while decoding, just after it
    finished, and after the batcher forgot it (keep_ended=0), twice each: every request gets
    exactly one final event, and the batcher ends at rest."""
    cfg = Config(lanes=1, kv_blocks=min_kv_blocks(1, False, "dynamic", 4), max_seq_len=256,
                 block_size=64, prefill_chunk=64)
    rt = SlowPrefill.tiny(cfg, seed=0)
    rt.delay = 0.01
    for keep in (10, 0):
        abort_everywhere(cfg, rt, keep)


def abort_everywhere(cfg: Config, rt: Any, keep: int) -> None:
    engine, ev = engine_with(cfg, rt, keep_ended=keep)
    engine.start()
    try:
        h_run = engine.submit(handle(ev, 0, [1] * 250, 5))  # 4 prefill chunks
        h_wait = engine.submit(handle(ev, 1, [2, 3], 5))      # waits behind it
        until(lambda: engine.call(lambda b: b.phase(0)) == core.PHASE_PREFILL)
        engine.abort(h_run)  # mid-prefill (applied after the chunk running now)
        engine.abort(h_wait)
        engine.abort(h_wait)
        until(lambda: final(ev[0]) and final(ev[1]))
        assert len(ev[0]) == 1 and ev[0][0].kind == "aborted"  # no token before
        h_dec = engine.submit(handle(ev, 2, [4, 5, 6], 200))
        until(lambda: any(e.kind == "token" for e in ev[2][1:]))
        engine.abort(h_dec)  # decoding
        until(lambda: final(ev[2]))
        h_fin = engine.submit(handle(ev, 3, [7], 2))
        until(lambda: final(ev[3]))
        engine.abort(h_fin)  # just finished
        engine.abort(h_fin)
        h_new = engine.submit(handle(ev, 4, [8], 2))  # (with keep 0: 3 is forgotten now)
        until(lambda: final(ev[4]))
        engine.abort(h_fin)  # gone
        engine.call(lambda b: None)  # (every abort above applied)
        for i in range(5):
            assert len(final(ev[i])) == 1, (i, ev[i])
        assert [final(ev[i])[0] for i in range(5)] == \
            ["aborted", "aborted", "aborted", "finished", "finished"]
        assert h_new.ended and not engine._live
        assert engine.call(lambda b: (b.check_invariants(), b.busy())[1]) is False
        assert engine.call(lambda b: core.OWNER_LANE not in b.state.owner)
        assert (3 in engine.call(lambda b: dict(b.requests))) == (keep == 10)
    finally:
        engine.stop()


def test_aborts_racing_the_engine_steps_end_each_request_once() -> None:
    """Sixty requests on two lanes, each aborted at a random moment from another thread (some
    before they run, some while they run, some after they end, some twice) while the engine
    steps: every one gets exactly one final event, the tokens before it, and nothing is held."""
    cfg = tiny_config(lanes=2)
    rt = SlowRuntime.tiny(cfg, seed=0)
    rt.delay = 0.002
    engine, ev = engine_with(cfg, rt)
    engine.start()
    rng = random.Random(7)
    try:
        handles = [engine.submit(handle(ev, i, [rng.randrange(128) for _ in range(5)],
                                        rng.randrange(1, 40))) for i in range(60)]
        for h in rng.sample(handles, 45) + rng.sample(handles, 10):
            time.sleep(rng.random() * 0.01)
            engine.abort(h)
        until(lambda: all(final(ev[i]) for i in range(60)), timeout=30)
        engine.call(lambda b: None)
        for i, h in enumerate(handles):
            kinds = [e.kind for e in ev[i]]
            assert len(final(ev[i])) == 1 and kinds[-1] in ("finished", "aborted"), kinds
            toks = [e.token for e in ev[i] if e.kind == "token"]
            assert toks == engine.call(lambda b, h=h: list(b.requests[h.rid].tokens))
        assert engine.call(lambda b: (b.check_invariants(), b.busy())[1]) is False
        assert engine.call(lambda b: core.OWNER_LANE not in b.state.owner)
    finally:
        engine.stop()


# ------------------------------------------------------------------ the queue (sound)
def test_the_queue_is_bounded_fcfs_and_full_is_a_clear_429() -> None:
    """Five streams on one lane with a queue of three: one runs, three wait and run in the order
    they came, and the fifth is a 429 `queue_full` at once (not queued without bound); room
    comes back as requests end."""
    with Server(tiny_config(lanes=1), delay=0.01, max_queue=3) as s:
        order: list[int] = []
        lock = threading.Lock()

        def stream(i: int) -> None:
            res = s.client().completions.create(model=MODEL, prompt=f"{LONG} {i}",
                                                max_tokens=50, temperature=0, stream=True)
            for k, _ch in enumerate(res):
                if k == 0:
                    with lock:
                        order.append(i)

        threads = []
        for i in range(4):
            threads.append(threading.Thread(target=stream, args=(i,)))
            threads[-1].start()
            # (its turn is fixed once it is in the batcher: the next one comes after)
            until(lambda i=i: s.engine.call(lambda b: len(b.requests)) == i + 1,
                  what=f"request {i} submitted")
        with pytest.raises(openai.RateLimitError) as exc:
            s.client().completions.create(model=MODEL, prompt="one too many", max_tokens=2)
        assert exc.value.body["code"] == "queue_full"
        for t in threads:
            t.join(20)
        assert order == [0, 1, 2, 3]
        at_rest(s)
        got = outcomes(s)
        assert got["rejected"] == 1 and got["length"] + got["stop"] == 4, got
        assert s.client().completions.create(model=MODEL, prompt="room", max_tokens=2,
                                             temperature=0).usage.completion_tokens >= 1


# ------------------------------------------------------------------ the last token (sound)
@pytest.mark.parametrize("stream", [False, True])
def test_an_end_at_the_last_allowed_token_has_one_right_finish_reason(stream: bool) -> None:
    """The end token, a stop token id or a stop string arriving with the max_tokens-th token
    (the batcher finishes the request in that same step): finish_reason "stop" exactly once,
    the text and the usage right, and one outcome counted per request."""
    with Server(tiny_config()) as s:
        c = s.client()
        prompt = "a long answer please"
        full = s.oracle(s.tok.encode(prompt), 200)
        assert full[-1] == s.tok.eos_token_id  # it ends with the end token, at len(full)
        k = next(i for i in range(10, 40) if full[i] not in full[:i] and 32 <= full[i] < 127)
        # a stop string that first completes at token k (ASCII, so it decodes alone)
        j = next(j for j in range(8, 40) if all(32 <= t < 127 for t in full[j - 2:j + 1])
                 and s.tok.decode(full[j - 2:j + 1]) not in s.tok.decode(full[:j]))
        stop = s.tok.decode(full[j - 2:j + 1])
        cases = [({"max_tokens": len(full)}, full, s.tok.decode(full)),
                 ({"max_tokens": k + 1, "extra_body": {"stop_token_ids": [full[k]]}},
                  full[:k + 1], s.tok.decode(full[:k])),  # (a stop id's text is not sent)
                 ({"max_tokens": j + 1, "stop": [stop]}, full[:j + 1],
                  s.tok.decode(full[:j - 2]))]
        for kwargs, ids, text in cases:
            extra = {**kwargs.pop("extra_body", {}), "return_token_ids": True}
            res = c.completions.create(model=MODEL, prompt=prompt, temperature=0, stream=stream,
                                       extra_body=extra, **kwargs,
                                       **({"stream_options": {"include_usage": True}}
                                          if stream else {}))
            chunks = list(res) if stream else [res]
            reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
            assert [r for r in reasons if r is not None] == ["stop"], (kwargs, reasons)
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
            got_ids = [t for ch in chunks if ch.choices for t in ch.choices[0].token_ids]
            assert got_ids == ids
            assert chunks[-1].usage.completion_tokens == len(ids)
        at_rest(s)
        got = outcomes(s)
        assert got["stop"] == 3 and sum(got.values()) == 3, got


# ------------------------------------------------------------------ the numbers (sound)
def test_state_and_metrics_agree_with_what_happened() -> None:
    """After a mix (served, stopped early, left mid-stream, left before its first token, timed
    out, refused with 429, invalid), /metrics counts each request once under its outcome, the
    batcher's tokens equal what the requests generated, and /state and the block gauges show
    nothing owned by a lane."""
    with Server(tiny_config(lanes=2), delay=0.01, max_queue=1, request_timeout=1.0) as s:
        c = s.client()
        served = c.completions.create(model=MODEL, prompt="count", max_tokens=7, temperature=0)
        stopped = c.completions.create(model=MODEL, prompt=LONG, max_tokens=50, temperature=0,
                                       extra_body={"stop_token_ids": [s.oracle(
                                           s.tok.encode(LONG), 5)[4]]})
        assert stopped.choices[0].finish_reason == "stop"
        with httpx.stream("POST", s.base + "/v1/completions", headers=AUTH,
                          json={"model": MODEL, "prompt": LONG, "max_tokens": 230,
                                "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # left after its first token
        at_rest(s)
        with pytest.raises(openai.InternalServerError) as exc:  # 230 x 10 ms > 1 s
            c.completions.create(model=MODEL, prompt=LONG, max_tokens=230, temperature=0)
        assert exc.value.status_code == 504
        at_rest(s)
        # two long ones fill both lanes, a third fills the queue, the fourth is refused
        socks = [open_stream(s.base, {"model": MODEL, "prompt": LONG, "max_tokens": 100,
                                      "temperature": 0, "stream": True}) for _ in range(3)]
        until(lambda: s.state()["in_flight"] == 3, what="three in flight")
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=MODEL, prompt="x", max_tokens=2, n=0)
        for sock in socks:  # (the queued one leaves before its first token)
            sock.close()
        st = at_rest(s)
        assert st["in_flight"] == 0 and not st["waiting"]
        want = {"stop": 1, "length": 0, "aborted": 4, "error": 0, "timeout": 1, "rejected": 1,
                "invalid": 1}
        want[served.choices[0].finish_reason] += 1
        assert outcomes(s) == want
        v = metric_values(s)
        requests = s.engine.call(lambda b: [len(r.tokens) for r in b.requests.values()])
        assert len(requests) == 7  # each admitted request reached the batcher once
        assert v[("atom_generated_tokens_total", ())] == sum(requests)
        assert v[("atom_kv_blocks", (("owner", "lane"),))] == 0
        assert v[("atom_busy_lanes", ())] == 0 and v[("atom_queue_depth", ())] == 0
        blocks = sum(val for (name, _), val in v.items() if name == "atom_kv_blocks")
        assert blocks == s.cfg.kv_blocks
        assert v[("atom_engine_up", ())] == 1
