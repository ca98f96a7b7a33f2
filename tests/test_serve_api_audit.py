"""The OpenAI front end against more bugs public serving engines have had in their
OpenAI-compatible endpoints, each through the real `openai` client (or a raw socket, where the
client cannot send what the bug needs) and a live server (tests/test_serve.py's `Server`): the
API key and the body bound checked before the body is read, nulls for optional parameters,
JSON types not coerced, logprobs=0 not silently dropped, a temperature near 0, an error in the
middle of a stream, and validation messages that say what would do."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator, Sequence

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_serve import KEY, MODEL, Server, tiny_config  # noqa: E402

from atom_core.serve.tokenizer import ByteTokenizer  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    with Server(tiny_config(), max_body_bytes=4096) as s:
        yield s


def raw_request(base: str, head: bytes, timeout: float = 3.0) -> bytes:
    """Send `head` (a request line and headers, maybe a body's start) and return what the
    server answers before `timeout`; the body the headers announce is never sent."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head)
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = sock.recv(4096)  # (a timeout here: the server waits for the body)
            if not chunk:
                break
            out += chunk
        return out


def announce(key: str, length: int) -> bytes:
    """A completion request's headers announcing a `length`-byte body, and its first byte."""
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n{{").encode()


def test_a_wrong_key_is_401_before_the_body_is_read(srv: Server) -> None:
    """The key was a route dependency, which runs after the body is read and parsed: a client
    without the key had its 1 GB body awaited (and read into memory) and a malformed body
    answered with a 400 that told it about the body, not the key."""
    head = raw_request(srv.base, announce("wrong", 10**9))
    assert head.startswith(b"HTTP/1.1 401")
    r = httpx.post(srv.base + "/v1/completions", content=b"{not json",
                   headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        srv.client("wrong").completions.create(model=MODEL, prompt=[True], max_tokens=-5)
    # every path but /health needs the key, as documented (the schema was open)
    assert httpx.get(srv.base + "/openapi.json").status_code == 401
    assert httpx.get(srv.base + "/openapi.json", headers=AUTH).status_code == 200
    assert httpx.get(srv.base + "/health").status_code == 200


def test_a_body_over_the_bound_is_413_before_it_is_read(srv: Server) -> None:
    """No bound at all before: any body was read whole into memory, then parsed."""
    head = raw_request(srv.base, announce(KEY, 10**9))
    assert head.startswith(b"HTTP/1.1 413")
    with pytest.raises(openai.APIStatusError) as exc:
        srv.client().completions.create(model=MODEL, prompt="x" * 5000, max_tokens=1)
    assert exc.value.status_code == 413
    assert exc.value.body["code"] == "request_too_large" and "4096" in exc.value.body["message"]

    def chunked() -> Iterator[bytes]:  # a body that declares no length
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    r = httpx.post(srv.base + "/v1/completions", content=chunked(), headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a body within the bound is served as before, streamed too
    c = srv.client()
    ok = c.completions.create(model=MODEL, prompt="x" * 200, max_tokens=2, temperature=0,
                              extra_body={"return_token_ids": True})
    assert ok.choices[0].token_ids == srv.oracle(srv.tok.encode("x" * 200), 2)
    parts = c.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, stream=True,
                                      messages=[{"role": "user", "content": "hi"}])
    assert [ch.choices[0].finish_reason for ch in parts if ch.choices][-1] is not None
    # the guard hands on the body, then the client's own messages: a client that leaves a
    # stream still has its request aborted, its blocks freed
    srv.runtime.delay = 0.01
    try:
        body = {"model": MODEL, "prompt": "never stop talking", "max_tokens": 230,
                "temperature": 0, "stream": True}
        t0 = time.time()
        with httpx.stream("POST", srv.base + "/v1/completions", json=body, headers=AUTH) as r:
            assert next(r.iter_lines()).startswith("data: ")
        st = srv.wait_at_rest(timeout=5)
        assert time.time() - t0 < 2.0  # well before its 230 tokens' 2.3 s
        assert all(own in ("free", "cache") for own in st["blocks"])
    finally:
        srv.runtime.delay = 0.0

    from atom_core.cli import build_parser
    from atom_core.serve.main import build

    args = ["serve", "--api-key", KEY, "--lanes", "1"]
    _app, _engine, settings = build(build_parser().parse_args([*args, "--max-body-bytes", "99"]))
    assert settings.max_body_bytes == 99
    with pytest.raises(SystemExit):  # (the option's type refuses it, before anything loads)
        build_parser().parse_args([*args, "--max-body-bytes", "0"])


def test_null_optional_parameters_mean_their_defaults(srv: Server) -> None:
    """OpenAI's schema makes these parameters nullable and clients send null for "not set";
    they were 400s ('Input should be a valid number')."""
    c = srv.client()
    prompt = "nulls are defaults"
    want = srv.oracle(srv.tok.encode(prompt), 6)
    res = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                               top_p=None, n=None, presence_penalty=None, frequency_penalty=None,
                               seed=None, stop=None, logprobs=None, echo=None, user=None,
                               stream_options=None,
                               extra_body={"return_token_ids": True, "top_k": None,
                                           "stream": None, "stop_token_ids": None})
    assert res.choices[0].token_ids == want
    messages = [{"role": "user", "content": "hi"}]
    res = c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                    max_tokens=None, temperature=0, logprobs=None,
                                    top_logprobs=None, top_p=None,
                                    extra_body={"return_token_ids": True})
    assert res.choices[0].token_ids == srv.oracle(srv.tok.chat(messages), 6)
    # a required one's null is still a 400 naming it
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt=None, max_tokens=2)
    assert exc.value.body["param"] == "prompt"


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"prompt": [True, False]}, "prompt"),  # was served as the token ids [1, 0]
    ({"prompt": [[5, True]]}, "prompt"),
    ({"max_tokens": True}, "max_tokens"),  # was 1
    ({"max_tokens": "3"}, "max_tokens"),  # was 3
    ({"temperature": "0"}, "temperature"),
    ({"extra_body": {"stop_token_ids": [False]}}, "stop_token_ids"),
    ({"extra_body": {"stream": "false"}}, "stream"),
])
def test_wrong_json_types_are_400_not_coerced(srv: Server, kwargs: dict, param: str) -> None:
    args = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        srv.client().completions.create(**args)
    assert exc.value.body["param"] == param and param in exc.value.body["message"]


def test_logprobs_zero_is_served_not_silently_dropped(srv: Server) -> None:
    """logprobs=0 asks for the chosen tokens' logprobs; it was served with `logprobs: null`
    (then refused, now served: tests/test_serve_vllm_params.py checks the values)."""
    c = srv.client()
    res = c.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=0)
    lp = res.choices[0].logprobs
    assert len(lp.token_logprobs) == 2 and all(len(d) == 1 for d in lp.top_logprobs)
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                  max_tokens=2, top_logprobs=2)
    assert exc.value.body["param"] == "top_logprobs"  # (was named 'logprobs')
    assert "top_logprobs" in exc.value.body["message"]


def test_a_temperature_near_zero_is_greedy_not_a_failed_request(srv: Server) -> None:
    """Logits divided by a temperature of 1e-310 overflow to inf and their softmax is NaN: the
    request failed with a 500 ('probability tensor contains either inf, nan')."""
    c = srv.client()
    prompt = "almost greedy"
    want = srv.oracle(srv.tok.encode(prompt), 8)
    for temperature in (1e-310, 1e-320):
        res = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                   temperature=temperature, seed=3,
                                   extra_body={"return_token_ids": True})
        assert res.choices[0].token_ids == want
        assert res.choices[0].finish_reason == srv.reason(want)


class DecodeFails(ByteTokenizer):
    """Decoding fails once the reply reaches the token `bomb`: a bug of the server's own side
    that strikes after a stream's response has started."""

    bomb: int | None = None

    def decode(self, ids: Sequence[int]) -> str:
        if self.bomb is not None and self.bomb in ids:
            raise RuntimeError("decoder bug")
        return super().decode(ids)


def sse_events(base: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", base + path, json=body, headers=AUTH) as r:
        assert r.status_code == 200
        raw = "".join(r.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == ""
    return events[:-1]


def test_an_error_mid_stream_is_an_error_event_then_done() -> None:
    """An exception out of the stream's body after the status line was sent cut the connection
    mid-body: no error event, no `data: [DONE]`, an incomplete chunked read for the client."""
    tok = DecodeFails()
    with Server(tiny_config(), tokenizer=tok) as s:
        prompt = "hi there"
        messages = [{"role": "user", "content": prompt}]
        cases = [("/v1/completions", {"prompt": prompt}, tok.encode(prompt)),
                 ("/v1/chat/completions", {"messages": messages}, tok.chat(messages))]
        for path, extra, ids in cases:
            want = s.oracle(ids, 12)
            # a token the reply has first at its fourth place or later: a few chunks go out
            tok.bomb = next(t for k, t in enumerate(want) if k >= 3 and t not in want[:k])
            body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, **extra}
            events = sse_events(s.base, path, body)
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(ev.removeprefix("data: ")) for ev in events[:-1]]
            errors = [ch["error"] for ch in chunks if "error" in ch]
            assert len(errors) == 1 and errors[0]["type"] == "server_error"
            assert "RuntimeError: decoder bug" in errors[0]["message"]
            assert "choices" in chunks[1]  # (text went out before the error)
        # the openai client raises it as an API error, not a broken connection
        want = s.oracle(tok.encode(prompt), 12)
        tok.bomb = next(t for k, t in enumerate(want) if k >= 3 and t not in want[:k])
        with pytest.raises(openai.APIError, match="decoder bug"):
            list(s.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                               temperature=0, stream=True))
        # each failed request was aborted in the engine; the server goes on
        s.wait_at_rest(timeout=5)
        tok.bomb = None
        res = s.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                            temperature=0, extra_body={"return_token_ids": True})
        assert res.choices[0].token_ids == want


def test_a_body_that_is_not_json_is_a_clear_400(srv: Server) -> None:
    """It said '1: JSON decode error' (a character position as if it were a parameter)."""
    r = httpx.post(srv.base + "/v1/completions", content=b'{"model": "tiny",, }',
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert msg.startswith("the request body is not valid JSON") and "character 17" in msg


def test_a_value_of_no_accepted_type_names_the_types(srv: Server) -> None:
    """A union's failure was reported under its first member's name ('stop.str: Input should
    be a valid string'), as if `stop` had to be a string."""
    c = srv.client()
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, stop=[1])
    assert exc.value.body["message"] == "stop: must be one of: str, list[str]"
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, max_tokens=2,
                                  messages=[{"role": "user", "content": {"text": "x"}}])
    assert exc.value.body["message"] == "messages.0.content: must be one of: str, list[TextPart]"
    assert exc.value.body["param"] == "messages"

