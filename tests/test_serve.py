"""`atom-core serve` against the real `openai` client over a real socket (uvicorn in a thread on
127.0.0.1, an ephemeral port): greedy output equals the reference runtime's oracle and the
batcher driven directly, token for token; streaming, auth, 400s naming the parameter, 429 on a
full queue, a disconnect that aborts its request and leaves every block at rest, metrics that
parse and match what was served, seeded sampling that repeats."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from atom_core._generated import core  # noqa: E402
from atom_core.batcher import AtomBatcher, Event  # noqa: E402
from atom_core.config import Config, min_kv_blocks  # noqa: E402
from atom_core.demo import oracle_for  # noqa: E402
from atom_core.runtime.reference import TorchReferenceRuntime  # noqa: E402
from atom_core.serve.app import ServerSettings, create_app  # noqa: E402
from atom_core.serve.engine import Engine  # noqa: E402
from atom_core.serve.sampling import Sampler, SamplingParams  # noqa: E402
from atom_core.serve.tokenizer import ByteTokenizer, HFTokenizer, build_tiny_tokenizer  # noqa: E402

KEY = "test-key"
MODEL = "tiny"


def tiny_config(lanes: int = 4) -> Config:
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, True, "dynamic", 4),
                  max_seq_len=256, block_size=64, prefill_chunk=64, prefix_cache=True)


class SlowRuntime(TorchReferenceRuntime):
    """The reference runtime, each decode call `delay` seconds slower: a long request stays in
    flight long enough for a client to go away (or a queue to fill) mid-generation."""

    delay = 0.0

    def decode(self, *args, **kwargs):
        time.sleep(self.delay)
        return super().decode(*args, **kwargs)


class Server:
    """uvicorn serving the app in a thread on 127.0.0.1, port chosen by the OS."""

    def __init__(self, cfg: Config, tokenizer=None, delay: float = 0.0, runtime=None,
                 **settings) -> None:
        """`runtime`: the one to serve (default: the seeded reference model, each call
        `delay` seconds late)."""
        self.tok = tokenizer or ByteTokenizer()
        self.cfg = cfg
        if runtime is None:
            runtime = SlowRuntime.tiny(cfg, seed=0, vocab_size=self.tok.vocab_size)
            runtime.delay = delay
        self.runtime = runtime
        self.engine = Engine(AtomBatcher(cfg, self.runtime))
        self.app = create_app(self.engine, self.tok,
                              ServerSettings(model_name=MODEL, api_key=KEY, **settings))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(api_key=key, base_url=self.base + "/v1", max_retries=0)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(api_key=KEY, base_url=self.base + "/v1", max_retries=0)

    def oracle(self, prompt: list[int], n: int) -> list[int]:
        return oracle_for(self.runtime).generate(prompt, n, self.tok.eos_token_id)

    def reason(self, tokens: list[int]) -> str:
        """The finish_reason of a greedy request that generated `tokens`."""
        return "stop" if tokens[-1] == self.tok.eos_token_id else "length"

    def state(self) -> dict:
        r = httpx.get(self.base + "/state", headers={"Authorization": f"Bearer {KEY}"})
        r.raise_for_status()
        return r.json()

    def wait_at_rest(self, timeout: float = 20.0) -> dict:
        """The server's state once nothing is in flight: no lane busy, nothing waiting, every
        block free or a prefix-cache entry."""
        deadline = time.time() + timeout
        while True:
            st = self.state()
            if st["in_flight"] == 0 and not st["waiting"] and \
                    all(ln["request"] is None for ln in st["lanes"]):
                return st
            assert time.time() < deadline, f"not at rest: {st}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def srv():
    with Server(tiny_config()) as s:
        yield s


def test_completion_greedy_equals_the_oracle(srv):
    c = srv.client()
    prompt = "Hello, verified scheduler"
    res = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                               extra_body={"return_token_ids": True})
    want = srv.oracle(srv.tok.encode(prompt), 12)
    (choice,) = res.choices
    assert choice.token_ids == want
    assert choice.text == srv.tok.decode(want)
    assert choice.finish_reason == srv.reason(want)
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(prompt), len(want))
    # the prompt as token ids
    ids = [5, 77, 130, 200, 31]
    res = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                               extra_body={"return_token_ids": True})
    assert res.choices[0].token_ids == srv.oracle(ids, 5)
    assert [m.id for m in c.models.list().data] == [MODEL]


def test_streaming_equals_non_streaming_and_the_oracle(srv):
    c = srv.client()
    prompt = "Streams of tokens"
    want = srv.oracle(srv.tok.encode(prompt), 20)
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True}))
    ids = [t for ch in chunks for choice in ch.choices for t in choice.token_ids]
    text = "".join(choice.text for ch in chunks for choice in ch.choices)
    assert ids == want and text == srv.tok.decode(want)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == srv.reason(want)
    assert chunks[-1].usage.completion_tokens == len(want)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    want = srv.oracle(srv.tok.chat(messages), 16)
    res = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                    temperature=0, extra_body={"return_token_ids": True})
    assert res.choices[0].token_ids == want
    assert res.choices[0].message.content == srv.tok.decode(want)
    stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                       temperature=0, stream=True)
    parts = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert "".join(parts) == srv.tok.decode(want)


def test_sse_framing_raw(srv):
    body = {"model": MODEL, "prompt": "raw", "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.base + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ") and "\n" not in ev
        assert json.loads(ev[len("data: "):])["object"] == "text_completion"


@pytest.mark.parametrize("with_ids", [True, False])
def test_sse_frames_from_the_template_equal_encoding_the_chunk(with_ids):
    """A stream's token frames come from a template rendered once; each is the very text that
    encoding its whole chunk gives, whatever the text (quotes, escapes, non-ASCII, NUL)."""
    from atom_core.serve.app import _Frames

    def chunk(text, toks, why, usage=None):
        return {"id": "cmpl-1", "object": "text_completion", "created": 7,
                "model": 'a "model"\u00e9', "choices": [{
                    "index": 0, "delta": {"content": text}, "logprobs": None,
                    "finish_reason": why, **({"token_ids": toks} if with_ids else {})}]}

    frame = _Frames(chunk)
    for text, toks, why in [("a", [97], None), ('\u00e9"\n\\', [1, 2], "stop"), ("", [], "length"),
                            ("\x00\u2603", [0], None), ("x", [3], "content_filter")]:
        want = "data: " + json.dumps(chunk(text, toks, why), separators=(",", ":")) + "\n\n"
        assert frame(text, toks, why) == want


def test_loop_histogram_exports_what_prometheus_histogram_does():
    """The lock-free latency histogram the server observes per token scrapes exactly as
    prometheus-client's own Histogram with the same buckets (but its _created line)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from atom_core.serve.metrics import _LATENCY, LoopHistogram

    theirs, ours = CollectorRegistry(), CollectorRegistry()
    h = Histogram("x_seconds", "doc", buckets=_LATENCY, registry=theirs)
    mine = LoopHistogram("x_seconds", "doc")
    ours.register(mine)
    for v in (0.0, 0.0005, 0.001, 0.003, 0.01, 0.7, 10.0, 20.0):
        h.observe(v)
        mine.observe(v)
    want = [ln for ln in generate_latest(theirs).decode().splitlines() if "_created" not in ln]
    assert generate_latest(ours).decode().splitlines() == want


def test_sixteen_concurrent_streams_are_exact(srv):
    prompts = [f"request {i}: " + "the shared system prompt " * (i % 3) for i in range(16)]
    lengths = [4 + (i * 7) % 23 for i in range(16)]

    async def one(client, prompt, n):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                                 temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True})
        return [t async for ch in stream for choice in ch.choices for t in choice.token_ids]

    async def main():
        # closed inside the loop that opened it: left to the collector, its close runs later
        # on a closed loop and asyncio logs an error into whichever test is running then
        async with srv.aclient() as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths,
                                                                             strict=True)))

    got = asyncio.run(main())
    # the same prompts through the batcher directly, on a fresh runtime of the same model
    b = AtomBatcher(srv.cfg, TorchReferenceRuntime.tiny(srv.cfg, seed=0,
                                                        vocab_size=srv.tok.vocab_size))
    rids = [b.submit(srv.tok.encode(p), n, srv.tok.eos_token_id)
            for p, n in zip(prompts, lengths, strict=True)]
    direct = b.run_until_done()
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        assert got[i] == direct[rids[i]].tokens == srv.oracle(srv.tok.encode(p), n), i
    srv.wait_at_rest()


def test_auth_is_required(srv):
    with pytest.raises(openai.AuthenticationError):
        srv.client("wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    r = httpx.post(srv.base + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(srv.base + "/metrics").status_code == 401
    assert httpx.get(srv.base + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"max_tokens": 500}, "max_tokens"),
    ({"prompt": "x" * 256}, "prompt"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"extra_body": {"tools": []}}, "tools"),
    ({"prompt": [1, 2, 999]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
])
def test_bad_input_is_400_naming_the_parameter(srv, kwargs, param):
    args = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        srv.client().completions.create(**args)
    assert exc.value.body["param"] == param
    assert param in exc.value.body["message"]


def test_unknown_model_and_chat_params(srv):
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        srv.client().completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as exc:
        srv.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert exc.value.body["param"] == "tools"


def test_stop_string_and_stop_token_ids(srv):
    c = srv.client()
    prompt = "Where does it stop?"
    want = srv.oracle(srv.tok.encode(prompt), 40)
    res = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                               extra_body={"stop_token_ids": [want[5]], "return_token_ids": True})
    k = want.index(want[5])
    assert res.choices[0].finish_reason == "stop"
    assert res.choices[0].token_ids == want[:k + 1]
    assert res.choices[0].text == srv.tok.decode(want[:k])
    # a stop string: a character of the full text; the text ends just before its first match
    full = srv.tok.decode(want)
    stop = next(ch for ch in full[3:] if ch.isprintable() and ch != "\ufffd")
    for stream in (False, True):
        res = c.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                   stop=stop, stream=stream)
        chunks = list(res) if stream else [res]
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == full[:full.index(stop)]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    srv.wait_at_rest()  # the stopped requests were aborted in the batcher


def test_client_disconnect_aborts_and_frees_every_block(srv):
    # 230 tokens take more than 2 s (this prompt's greedy reply has no end token; "a long
    # answer please" ends at 57, so a slow client could see it finish instead of aborting it)
    srv.runtime.delay = 0.01
    body = {"model": MODEL, "prompt": "never stop talking", "max_tokens": 230,
            "temperature": 0, "stream": True}
    before = srv.engine.call(lambda b: b.stats.generated_tokens)
    with httpx.stream("POST", srv.base + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert got and all(x.startswith("data: ") for x in got)
    # closing the response closed the socket: the server aborts the request
    st = srv.wait_at_rest()
    assert all(own in ("free", "cache") for own in st["blocks"]), st["blocks"]

    def last(b):
        b.check_invariants()
        rid = max(b.requests)
        return b.requests[rid], b.stats.generated_tokens

    srv.runtime.delay = 0.0
    req, after = srv.engine.call(last)
    assert req.ended and req.error == "aborted"
    assert len(req.tokens) < 230 and after - before < 230
    # nothing leaked: no block is owned by a lane or pinned for a transfer
    owners = srv.engine.call(lambda b: list(b.state.owner))
    assert not {core.OWNER_LANE, core.OWNER_DRAINING, core.OWNER_SPILLING} & set(owners)


def test_full_queue_is_429():
    with Server(tiny_config(lanes=1), delay=0.01, max_queue=0) as s:
        body = {"model": MODEL, "prompt": "occupy the only lane", "max_tokens": 230,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", s.base + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()  # (kept: a dropped iterator closes the response)
            assert next(lines).startswith("data: ")  # it is running
            with pytest.raises(openai.RateLimitError) as exc:
                s.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert exc.value.body["code"] == "queue_full"
            assert s.state()["in_flight"] == 1
        s.wait_at_rest()  # (the first one was aborted when its client left)
        # room again
        assert s.client().completions.create(model=MODEL, prompt="x", max_tokens=2,
                                             temperature=0).choices[0].text is not None


def test_metrics_parse_and_match_what_was_served():
    with Server(tiny_config()) as s:
        c = s.client()
        served = [c.completions.create(model=MODEL, prompt=f"count {i}", max_tokens=3 + i,
                                       temperature=0) for i in range(3)]
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=MODEL, prompt="x", max_tokens=1, n=0)
        text = httpx.get(s.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        outcomes = {smp.labels["outcome"]: smp.value for smp in fams["atom_requests"].samples
                    if smp.name == "atom_requests_total"}
        reasons = [r.choices[0].finish_reason for r in served]
        assert outcomes["length"] == reasons.count("length")
        assert outcomes["stop"] == reasons.count("stop")
        assert outcomes["invalid"] == 1 and outcomes["rejected"] == 0
        total = sum(r.usage.completion_tokens for r in served)
        value = {smp.name: smp.value for f in fams.values() for smp in f.samples}
        assert value["atom_completion_tokens_total"] == total
        assert value["atom_generated_tokens_total"] == total
        assert value["atom_prompt_tokens_total"] == sum(r.usage.prompt_tokens for r in served)
        assert value["atom_time_to_first_token_seconds_count"] == 3
        assert value["atom_inter_token_latency_seconds_count"] == total - 3
        assert value["atom_busy_lanes"] == 0 and value["atom_queue_depth"] == 0
        # the engine's steps and its CPU inside them (what bench.serve sets the rest against)
        assert value["atom_engine_steps_total"] == s.engine.steps > 0
        assert 0 < value["atom_engine_step_cpu_seconds_total"] == s.engine.step_cpu
        # (their wall time holds their CPU time; the rest is waiting: the GIL, a core)
        assert value["atom_engine_step_seconds_total"] == s.engine.step_wall >= s.engine.step_cpu
        blocks = {smp.labels["owner"]: smp.value for smp in fams["atom_kv_blocks"].samples}
        assert sum(blocks.values()) == s.cfg.kv_blocks and blocks["lane"] == 0


def test_seeded_sampling_repeats_and_follows_the_logits(srv):
    c = srv.client()
    args = {"model": MODEL, "prompt": "sample me", "max_tokens": 10, "temperature": 0.9,
            "top_p": 0.95, "seed": 1234, "extra_body": {"return_token_ids": True, "top_k": 50}}
    a = c.completions.create(**args).choices[0].token_ids
    b = c.completions.create(**args).choices[0].token_ids
    assert a == b
    # the same draws, by hand, from the oracle's logits: the server sampled from the real ones
    sampler = Sampler(SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234))
    seq, want = srv.tok.encode("sample me"), []
    for _ in range(10):
        t = sampler(srv.runtime.oracle_logits(seq))
        want.append(t)
        seq.append(t)
        if t == srv.tok.eos_token_id:
            break
    assert a == want
    assert a != srv.oracle(srv.tok.encode("sample me"), 10)  # it did not just argmax


def test_model_directory_tokenizer_and_chat_template(tmp_path):
    tok = HFTokenizer(build_tiny_tokenizer(tmp_path / "model"))
    with Server(tiny_config(), tokenizer=tok) as s:
        messages = [{"role": "user", "content": "The quick brown fox"}]
        prompt = tok.chat(messages)
        assert tok.decode(prompt) == "<|user|>\nThe quick brown fox\n<|assistant|>\n"
        res = s.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                 temperature=0,
                                                 extra_body={"return_token_ids": True})
        want = s.oracle(prompt, 8)
        assert res.choices[0].token_ids == want
        assert res.choices[0].message.content == tok.decode(want)


def test_cli_serves_and_exits_0_on_sigterm():
    env = {**os.environ, "ATOM_CORE_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "atom_core.cli", "serve", "--port", "0",
                             "--lanes", "2", "--log-level", "info"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in proc.stderr:
            if m := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
                break
        assert port, "no port printed"
        c = openai.OpenAI(api_key=KEY, base_url=f"http://127.0.0.1:{port}/v1", max_retries=0)
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                    temperature=0).usage.completion_tokens == 3
        # SIGTERM mid-stream: the stream is drained to its end, then the server exits 0
        body = {"model": MODEL, "prompt": "occupy the only lane", "max_tokens": 230,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_request_timeout_aborts_the_request():
    with Server(tiny_config(), delay=0.01, request_timeout=0.3) as s:
        with pytest.raises(openai.InternalServerError) as exc:
            s.client().completions.create(model=MODEL, prompt="occupy the only lane",
                                          max_tokens=230, temperature=0)
        assert exc.value.status_code == 504 and "0.3 s" in exc.value.body["message"]
        st = s.wait_at_rest()
        assert all(own in ("free", "cache") for own in st["blocks"])
        assert s.engine.call(lambda b: b.requests[0].error) == "aborted"


def test_shutdown_ends_requests_in_flight():
    """Stopping the engine (the app's shutdown) ends a request still running: its stream gets
    an error event and [DONE] instead of hanging."""
    with Server(tiny_config(), delay=0.01) as s:
        body = {"model": MODEL, "prompt": "occupy the only lane", "max_tokens": 230,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", s.base + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            s.engine.stop()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(rest[-2][len("data: "):])["error"]["message"]
        assert httpx.get(s.base + "/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as exc:
            s.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert exc.value.status_code == 503


def test_batcher_sampler_hook_under_preemption():
    """The hook itself: each generated token comes from the request's sampler, once per token,
    also across a preemption (the recomputed prefill's last chunk draws the next token)."""
    cfg = Config(lanes=2, kv_blocks=min_kv_blocks(2, False, "dynamic", 4, True), max_seq_len=256,
                 block_size=64, prefill_chunk=64, preemption=True)
    rt = TorchReferenceRuntime.tiny(cfg, seed=0)
    b = AtomBatcher(cfg, rt)
    params = [SamplingParams(temperature=0.7, top_k=20, seed=s) for s in (1, 2)]
    prompts = [[(7 * i + 3) % 128 for i in range(70)], [(5 * i + 1) % 128 for i in range(90)]]
    rids = [b.submit(p, 120, sampler=Sampler(sp)) for p, sp in zip(prompts, params, strict=True)]
    out = b.run_until_done()
    assert b.stats.preemptions > 0  # both tables cannot grow at once
    for rid, p, sp in zip(rids, prompts, params, strict=True):
        sampler, seq, want = Sampler(sp), list(p), []
        while len(want) < 120 and len(seq) <= cfg.max_seq_len:
            t = sampler(rt.oracle_logits(seq))
            want.append(t)
            seq.append(t)
        assert out[rid].error is None and out[rid].tokens == want


def test_cli_refuses_to_serve_without_a_key(capsys):
    from atom_core.cli import main

    env = os.environ.pop("ATOM_CORE_API_KEY", None)
    try:
        assert main(["serve", "--port", "0"]) == 2
    finally:
        if env is not None:
            os.environ["ATOM_CORE_API_KEY"] = env
    assert "no API key" in capsys.readouterr().err


def test_cli_model_directory_builds_its_tokenizer_and_a_matching_runtime(tmp_path):
    from atom_core.cli import build_parser
    from atom_core.serve.main import build

    model = build_tiny_tokenizer(tmp_path / "model")
    args = build_parser().parse_args(["serve", "--model", str(model), "--api-key", KEY,
                                      "--lanes", "2", "--no-prefix-cache"])
    _app, engine, settings = build(args)
    assert settings.model_name == str(model)  # (the model as given, as vLLM's)
    assert engine.batcher.runtime.vocab_size == 320
    cfg = engine.batcher.config
    assert (cfg.lanes, cfg.prefix_cache, cfg.kv_blocks) == \
        (2, False, min_kv_blocks(2, False, "dynamic", cfg.blocks_per_table))
    with pytest.raises(ValueError, match="nope: no such directory"):
        build(build_parser().parse_args(["serve", "--model", str(tmp_path / "nope"),
                                         "--api-key", KEY]))
    with pytest.raises(ValueError, match="--runtime cuda: unknown"):
        build(build_parser().parse_args(["serve", "--runtime", "cuda", "--api-key", KEY]))


def test_inbox_wakes_at_the_first_token_then_every_n():
    """`--stream-interval N`: the reader wakes at the first token, then at every N-th, and at
    once for anything that is not a token (the end, an error)."""
    from atom_core.serve.app import _Inbox

    def tok(i: int) -> Event:
        return Event("token", 0, token=i)

    async def run() -> list[list[int | str]]:
        inbox, takes = _Inbox(every=3), []

        async def reader() -> None:
            while True:
                evs = await inbox.take()
                takes.append([e.token if e.kind == "token" else e.kind for e in evs])
                if evs[-1].kind == "finished":
                    return

        task = asyncio.create_task(reader())
        for i in range(8):
            inbox.put(tok(i))
            await asyncio.sleep(0)  # (the reader runs whenever it was woken)
        inbox.put(Event("finished", 0))
        await task
        return takes

    assert asyncio.run(run()) == [[0], [1, 2, 3], [4, 5, 6], [7, "finished"]]


def test_stream_interval_keeps_every_token_and_the_stop_string():
    with Server(tiny_config(), stream_interval=4) as s:
        c = s.client()
        want = s.oracle(s.tok.encode("Bursts"), 23)
        chunks = list(c.completions.create(model=MODEL, prompt="Bursts", max_tokens=23,
                                           temperature=0, stream=True,
                                           extra_body={"return_token_ids": True}))
        assert [t for ch in chunks for t in ch.choices[0].token_ids] == want
        assert chunks[-1].choices[0].finish_reason == s.reason(want)
        text = s.tok.decode(want)
        stop = text[5:7]  # ends the request at its first occurrence, mid-interval or not
        got = "".join(ch.choices[0].text for ch in c.completions.create(
            model=MODEL, prompt="Bursts", max_tokens=23, temperature=0, stream=True, stop=[stop]))
        assert got == text[:text.index(stop)]
        s.wait_at_rest()


def test_cli_refuses_a_stream_interval_below_one(capsys):
    from atom_core.cli import main

    with pytest.raises(SystemExit) as e:  # the option's type: a usage error, as argparse's
        main(["serve", "--port", "0", "--api-key", KEY, "--stream-interval", "0"])
    assert e.value.code == 2
    assert "argument --stream-interval: must be an integer in 1..1000000, got '0'" \
        in capsys.readouterr().err
