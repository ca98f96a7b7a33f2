"""Edge cases of `atom-core serve` that OpenAI-compatible servers have got wrong, each through a
live server (tests/test_serve.py's `Server`) and the real `openai` client, a raw socket where a
client must misbehave, or the real engine thread where the timing of its events is the point.

Fixed here: a chat message's `name` never reached the chat template; `--request-timeout` did not
end a stream stuck writing to a client that stopped reading (the connection and its buffers
stayed held for as long as the client liked); an aborted request's final event reached its
client only after the engine's next step; a completion's text lost the space its first word
continues the prompt with (SentencePiece decoders strip a text's first space); a body sent
without `Content-Type: application/json` (curl -d), empty, or JSON but no object got a 400
that did not say why."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_serve import MODEL, Server, SlowRuntime, tiny_config  # noqa: E402
from test_serve_compat_audit import AUTH, post, served_exactly, srv  # noqa: E402, F401 (a fixture)
from test_serve_lifecycle_audit import LONG, open_stream, until  # noqa: E402

from atom_core.batcher import AtomBatcher, Event  # noqa: E402
from atom_core.config import Config, min_kv_blocks  # noqa: E402
from atom_core.serve.engine import Engine, Handle  # noqa: E402
from atom_core.serve.tokenizer import (  # noqa: E402
    ByteTokenizer,
    HFTokenizer,
    IncrementalText,
    build_tiny_tokenizer,
)

# ------------------------------------------------------------------ 1. a message's name (fixed)
# a template that renders a message's name, as some models' do ("<|user name=alice|>")
NAMED = ("{% for m in messages %}<|{{ m['role'] }}{% if m['name'] %} name={{ m['name'] }}"
         "{% endif %}|>\n{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("model"))


def test_a_message_name_reaches_a_template_that_renders_it(model_dir: Path) -> None:
    """Bug: only role and content went to the chat template, so `name` (which OpenAI allows on
    system, user and assistant messages) was dropped silently. A template that ignores it is
    unaffected; a non-string name is a 400 that says what to send."""
    tok = HFTokenizer(model_dir)
    tok._tok.chat_template = NAMED
    named = [{"role": "system", "content": "Be brief.", "name": "rules"},
             {"role": "user", "content": "The quick brown fox", "name": "alice"}]
    prompt = tok.chat(named)
    assert "<|user name=alice|>" in tok.decode(prompt)
    with Server(tiny_config(), tokenizer=tok) as s:
        served_exactly(s, named, prompt, 4)
        r = post(s, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi", "name": 7}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages"
        assert "messages.0.name" in err["message"] and "string" in err["message"]
    # a template that ignores names (the tiny model's own) gives the prompt it gave without one
    plain = HFTokenizer(model_dir)
    with Server(tiny_config(), tokenizer=plain) as s:
        res = s.client().chat.completions.create(model=MODEL, messages=named, max_tokens=2,
                                                 temperature=0)
        unnamed = [{k: v for k, v in m.items() if k != "name"} for m in named]
        assert res.usage.prompt_tokens == len(plain.chat(unnamed))


# ------------------------------------------------------------------ 2. a stuck write (fixed)
class Wide(ByteTokenizer):
    """Each character decodes 10,000 times over: a 230-token stream is megabytes of SSE, more
    than the loopback socket buffers hold, so a client that does not read makes the server
    wait on it."""

    def decode(self, ids: Any) -> str:
        return "".join(c * 10_000 for c in super().decode(ids))


def read_to_end(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sent until it closed the connection (a timeout fails)."""
    sock.settimeout(timeout)
    raw = bytearray()
    while True:
        try:
            part = sock.recv(1 << 20)
        except ConnectionResetError:
            return bytes(raw)
        if not part:
            return bytes(raw)
        raw += part


def test_the_request_timeout_also_ends_a_write_the_client_does_not_read() -> None:
    """Bug: --request-timeout ended the request (its lane came back) but not its stream, stuck
    writing to a client that stopped reading: the connection, and the rest of the reply
    waiting for it, stayed held for as long as the client liked. Now, a moment past the
    deadline, the server drops the connection (its buffered bytes too); others are served
    meanwhile and the server is at rest."""
    # (the deadline leaves room for the 230 tokens on a loaded machine: the stream must be
    # stuck with all of them generated when it passes, or the reply may fit the socket buffers)
    with Server(tiny_config(lanes=1), tokenizer=Wide(), max_queue=0,
                request_timeout=4.0) as s:
        connections = s.server.server_state.connections
        slow = open_stream(s.base, {"model": MODEL, "prompt": LONG, "max_tokens": 230,
                                    "temperature": 0, "stream": True}, rcvbuf=4096)
        try:
            until(lambda: s.state()["stats"]["generated_tokens"] == 230, what="generation")
            with s.client() as c:  # another client is served while the stream is stuck
                res = c.completions.create(model=MODEL, prompt="next", max_tokens=3,
                                           temperature=0)
                assert res.usage.completion_tokens == 3
            # (the stuck stream's is the only connection left: the others were closed)
            until(lambda: not connections, timeout=20.0, what="the stuck stream to be dropped")
            raw = read_to_end(slow)
        finally:
            slow.close()
        assert raw.startswith(b"HTTP/1.1 200")
        # cut mid-body: no [DONE], no chunked end (the whole reply is megabytes more)
        assert b"[DONE]" not in raw and not raw.endswith(b"\r\n0\r\n\r\n")
        st = s.wait_at_rest()
        assert all(own in ("free", "cache") for own in st["blocks"])


def test_a_stream_read_past_its_timeout_still_ends_with_the_error_and_done() -> None:
    """The bound on sending leaves a client that reads what it was promised: at the deadline
    its stream ends with the timeout's error event and [DONE], not a cut connection."""
    with Server(tiny_config(lanes=1), delay=0.01, request_timeout=0.5) as s:
        with httpx.stream("POST", s.base + "/v1/completions", headers=AUTH, timeout=10, json={
                "model": MODEL, "prompt": LONG, "max_tokens": 230, "temperature": 0,
                "stream": True}) as r:
            frames = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert frames[-1] == "data: [DONE]"
        err = json.loads(frames[-2][len("data: "):])["error"]
        assert err["code"] == "timeout" and "0.5 s" in err["message"]
        s.wait_at_rest()


# ------------------------------------------------------------------ 3. abort events (fixed)
class Gated(SlowRuntime):
    """Decode calls wait for a permit while `hold` is set: the test decides when a step ends."""

    hold = False
    permits = threading.Semaphore(0)
    waiting = threading.Event()  # a decode call waits for its permit

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        if self.hold:
            self.waiting.set()
            self.permits.acquire(timeout=30)
        return super().decode(*args, **kwargs)


def test_an_abort_reaches_its_client_before_the_next_step() -> None:
    """Bug: the engine applied an abort (the batcher freed the lane at once) but handed its
    final event over only with the next step's events, so the client waited a whole step (a
    long prefill chunk, or a slow decode of everyone else) to learn its request ended."""
    cfg = Config(lanes=2, kv_blocks=min_kv_blocks(2, False, "dynamic", 4), max_seq_len=256,
                 block_size=64, prefill_chunk=64)
    rt = Gated.tiny(cfg, seed=0)
    rt.permits, rt.waiting = threading.Semaphore(0), threading.Event()
    engine = Engine(AtomBatcher(cfg, rt), idle_wait=0.01)
    events: dict[int, list[Event]] = {0: [], 1: []}
    ended = threading.Event()

    def sink(i: int) -> Callable[[Event], None]:
        def put(ev: Event) -> None:
            events[i].append(ev)
            if ev.kind == "aborted":
                ended.set()
        return put

    a = Handle([1, 2, 3], 200, None, None, sink=sink(0))
    b = Handle([4, 5, 6], 200, None, None, sink=sink(1))
    engine.start()
    try:
        engine.submit(a)
        engine.submit(b)
        until(lambda: len(events[0]) > 2 and len(events[1]) > 2, what="both decoding")
        rt.hold = True
        assert rt.waiting.wait(5)  # the engine is inside a step
        engine.abort(a)  # (applied once that step ends)
        rt.permits.release()  # that step ends; the next one waits for the test
        assert ended.wait(5), "the abort's event waited for the next step"
        assert [e.kind for e in events[0]][-1] == "aborted"
    finally:
        rt.hold = False
        for _ in range(4):
            rt.permits.release()
        engine.stop()


# ------------------------------------------------------------ 4. a reply's first space (fixed)
def test_a_completion_keeps_the_space_its_first_word_continues_the_prompt_with(
        tmp_path: Path) -> None:
    """Bug: a completion's text was its tokens decoded on their own, and a SentencePiece
    decoder (Llama 2's, Gemma's, Mistral's) strips the space a text begins with: "The quick"
    continued with "▁brown" came back as "brown", so prompt + text ran the words together.
    Now the prompt's last tokens are the decoding's context: the text is what the prompt and
    the reply decode to beyond the prompt, streamed or not. (A chat reply, a message of its
    own, still starts afresh.)"""
    from test_serve_text import metaspace_tokenizer

    path = tmp_path / "metaspace"
    metaspace_tokenizer(path)
    tok = HFTokenizer(path)
    with Server(tiny_config(), tokenizer=tok) as s:
        prompt = [256, 15]  # (its greedy reply begins with the word "▁b": found by search)
        gen = s.oracle(prompt, 6)
        assert tok._tok.convert_ids_to_tokens(gen[0]) == "▁b"
        head, whole = tok.decode(prompt), tok.decode(prompt + gen)
        assert whole.startswith(head + " ")
        want = whole[len(head):]
        c = s.client()
        res = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert res.choices[0].text == want
        chunks = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                      stream=True)
        assert "".join(ch.choices[0].text for ch in chunks) == want


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from test_serve_audit import byte_fallback_tokenizer
    from test_serve_text import metaspace_tokenizer

    base = tmp_path_factory.mktemp("tok")
    return {"bytes": ByteTokenizer(), "bpe": HFTokenizer(build_tiny_tokenizer(base / "bpe")),
            "fallback": byte_fallback_tokenizer(base / "fallback"),
            "metaspace": HFTokenizer(metaspace_tokenizer(base / "metaspace"))}


@pytest.mark.parametrize("name", ["bytes", "bpe", "fallback", "metaspace"])
@given(text=st.text(st.sampled_from(list("ab ,.") + ["é", "€", "😀"]), max_size=30),
       at=st.integers(0, 30))
def test_a_continuation_is_what_prompt_and_reply_decode_to_beyond_the_prompt(
        tokenizers: dict[str, Any], name: str, text: str, at: int) -> None:
    """One text's tokens split into a prompt and a reply anywhere (a character's bytes
    included): the reply streamed with the prompt as context is the whole decoded beyond the
    prompt decoded, whenever the prompt decodes to whole characters (a prompt ending inside
    one has no context: its reply's text starts afresh, as it did)."""
    tok = tokenizers[name]
    ids = [t for t in tok.encode(text) if t != tok.eos_token_id]
    prompt, reply = ids[:at], ids[at:]
    head, whole = tok.decode(prompt), tok.decode(ids)
    stream = IncrementalText(tok, (), prompt)
    got = "".join(stream.add(t) for t in reply) + stream.finish()
    if "\ufffd" in head or not whole.startswith(head):
        assert got == tok.decode(reply) or whole.endswith(got)
        return
    assert got == whole[len(head):]


# ------------------------------------------------------- 5. a body not sent as JSON (fixed)
@pytest.mark.parametrize(("headers", "body", "says"), [
    # curl -d without -H: a form's Content-Type
    ({"content-type": "application/x-www-form-urlencoded"}, b'{"model": "tiny"}',
     "came as 'application/x-www-form-urlencoded'"),
    ({}, b'{"model": "tiny"}', "came without one"),  # requests.post(data=...)
    ({"content-type": "application/json"}, b"", "the request body is empty"),
    ({"content-type": "application/json"}, b'[{"model": "tiny"}]', "not a JSON array"),
])
def test_a_body_that_is_no_json_object_is_a_400_that_says_why(
        srv: Server, headers: dict[str, str], body: bytes, says: str) -> None:  # noqa: F811
    """Bug: each was 'body: Input should be a valid dictionary or object to extract fields
    from' (or 'body: Field required'), though most were valid JSON a header short."""
    r = httpx.post(srv.base + "/v1/completions", content=body, headers={**AUTH, **headers})
    assert r.status_code == 400
    err = r.json()["error"]
    assert says in err["message"], err
    if "came" in says:
        assert "Content-Type: application/json" in err["message"]
