"""Issue 49, round three, item 4: the HTTP server is total in its request body and its routes.
Each bad input goes to a live server (tests/test_serve.py's `Server`) as raw bytes, since the
`openai` client cannot send them; then the same server serves the real client exactly, and
nothing it logged carries a traceback.

Fixed here: a lone surrogate (JSON can carry "\\ud800" as an escape) in any string (the prompt,
`model`, a message's content or name, `stop`, ...) reached an encoder and was a 500 with a
traceback in the log; a body not UTF-8, nested 10,000 deep, or holding 1e999 or a 5,000-digit
integer, and an unknown path or a method a path does not take, were answered with FastAPI's
`{"detail": ...}`, which names neither the problem nor the field. Every error now has the
OpenAI shape and names what is wrong and where."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_serve import KEY, MODEL, Server, tiny_config  # noqa: E402

from atom_core.serve.protocol import MAX_DEPTH, MAX_DIGITS, BodyError, parse_body  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


class Records(logging.Handler):
    """Every record logged while attached (from the server's thread too)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Server, Records]]:
    s = Server(tiny_config())
    # attached after uvicorn configured its loggers (which drops their handlers): the app's
    # loggers reach the root's, uvicorn's stop at "uvicorn" (propagate=False)
    rec = Records()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for lg in loggers:
        lg.addHandler(rec)
    try:
        with s:
            yield s, rec
    finally:
        for lg in loggers:
            lg.removeHandler(rec)


@pytest.fixture
def srv(served: tuple[Server, Records]) -> Server:
    return served[0]


def send(s: Server, path: str, body: bytes, method: str = "POST") -> httpx.Response:
    return httpx.request(method, s.base + path, content=body, headers=JSON, timeout=30)


def api_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error of `r`, checked to be exactly that shape with `status`."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json", r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    return err


# ------------------------------------------------------------------ lone surrogates
def cmpl(**fields: str) -> bytes:
    """A completion body with `fields` spliced in as raw JSON (their escapes stay escapes)."""
    base = {"model": '"tiny"', "prompt": '"x"', "max_tokens": "2", **fields}
    return ("{" + ", ".join(f'"{k}": {v}' for k, v in base.items())).encode() + b"}"


def chat(message: str, **fields: str) -> bytes:
    base = {"model": '"tiny"', "max_tokens": "2", "messages": f"[{message}]", **fields}
    return ("{" + ", ".join(f'"{k}": {v}' for k, v in base.items())).encode() + b"}"


LONE = [  # (path, body, where the message says it is, param)
    (CMPL, cmpl(prompt=r'"ab\ud800"'), "prompt:", "prompt"),
    (CMPL, cmpl(prompt=r'["\udfff"]'), "prompt.0:", "prompt"),
    (CMPL, cmpl(model=r'"tiny\ud800"'), "model:", "model"),
    (CMPL, cmpl(stop=r'"\ud800"'), "stop:", "stop"),
    (CMPL, cmpl(stop=r'["ok", "\udc00x"]'), "stop.1:", "stop"),
    (CMPL, cmpl(user=r'"\ud800"'), "user:", "user"),
    # an unknown parameter's value and name: no field reads them, the parse still refuses
    (CMPL, cmpl(metadata=r'{"k": "\ud800"}'), "metadata.k:", "metadata"),
    (CMPL, cmpl(**{r"\ud800": "1"}), r'"\ud800": this key', r'"\ud800"'),
    (CHAT, chat(r'{"role": "user", "content": "\ud800"}'), "messages.0.content:", "messages"),
    (CHAT, chat(r'{"role": "user", "content": [{"type": "text", "text": "a"}, '
                r'{"type": "text", "text": "\ud800"}]}'),
     "messages.0.content.1.text:", "messages"),
    (CHAT, chat(r'{"role": "user", "content": "hi", "name": "\ud800"}'),
     "messages.0.name:", "messages"),
    (CHAT, chat(r'{"role": "user\ud800", "content": "hi"}'), "messages.0.role:", "messages"),
    (CHAT, chat('{"role": "user", "content": "hi"}', stop=r'["\ud800"]'), "stop.0:", "stop"),
    (CHAT, chat('{"role": "user", "content": "hi"}', model=r'"\ud800"'), "model:", "model"),
    (CMPL, rb'"\ud800"', "the request body:", None),
]


@pytest.mark.parametrize(("path", "body", "where", "param"), LONE)
def test_a_lone_surrogate_anywhere_is_a_400_naming_its_place(
        srv: Server, path: str, body: bytes, where: str, param: str | None) -> None:
    """It was a 500 ('internal error: UnicodeEncodeError') with a traceback in the log, where
    the text reached an encoder: the tokenizer (prompt, content), the error's own JSON (model,
    an unknown parameter's name)."""
    err = api_error(send(srv, path, body), 400)
    assert err["message"].startswith(where), err
    assert "lone surrogate" in err["message"], err
    assert err["param"] == param


def test_a_surrogate_pair_is_its_character(srv: Server) -> None:
    """Only a lone surrogate is refused: a pair (how JSON escapes a character past U+FFFF) is
    the character, served exactly."""
    r = send(srv, CMPL, cmpl(prompt=r'"\ud83d\ude00 ok"', temperature="0",
                             return_token_ids="true"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == srv.oracle(srv.tok.encode("😀 ok"), 2)


# ------------------------------------------------------------------ bodies that are no JSON
BAD_BODIES = [  # (body, what the message says, param)
    (b'{"model": "tiny", "prompt": "\xff"}', "not UTF-8 text", None),
    # a surrogate as UTF-8 would spell it: json.loads(bytes) decoded it ('surrogatepass')
    (b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', "not UTF-8 text", None),
    (b'{"model": "tiny", "prompt": "x\xc3"}', "not UTF-8 text", None),
    (b"[" * 10_000 + b"]" * 10_000, f"more than {MAX_DEPTH} deep", None),
    (b'{"a": ' * 10_000 + b"1" + b"}" * 10_000, f"more than {MAX_DEPTH} deep", None),
    # deep enough to refuse, not enough for json.loads's own bound
    (cmpl(user="[" * 100 + "]" * 100), f"more than {MAX_DEPTH} deep", None),
    (cmpl(temperature="1e999"), "temperature: a number too large", "temperature"),
    (cmpl(top_p="-1e999"), "top_p: a number too large", "top_p"),
    (cmpl(temperature="NaN"), "temperature: NaN is not JSON", "temperature"),
    (cmpl(temperature="Infinity"), "temperature: Infinity is not JSON", "temperature"),
    (cmpl(max_tokens="9" * 5000), "max_tokens: a 5000-digit integer", "max_tokens"),
    (cmpl(max_tokens="-" + "1" * 10_000), "max_tokens: a 10000-digit integer", "max_tokens"),
    (cmpl(prompt="[1, 2, " + "3" * 5000 + "]"), "prompt.2: a 5000-digit integer", "prompt"),
    (cmpl(seed="1" * (MAX_DIGITS + 1)), f"seed: a {MAX_DIGITS + 1}-digit integer", "seed"),
    (b'{"model": "tiny",, }', "not valid JSON: Expecting property name", None),
]


@pytest.mark.parametrize(("body", "says", "param"), BAD_BODIES)
def test_a_body_no_request_could_be_is_a_400_that_says_why(
        srv: Server, body: bytes, says: str, param: str | None) -> None:
    """These were FastAPI's `{"detail": "There was an error parsing the body"}` (invalid UTF-8,
    deep nesting, a 5000-digit integer), or values no field can take reaching the fields
    (1e999 as infinity, NaN)."""
    for path in (CMPL, CHAT):
        err = api_error(send(srv, path, body), 400)
        assert says in err["message"], err
        assert err["param"] == param


def test_a_bom_and_the_largest_integers_still_parse(srv: Server) -> None:
    """What json.loads of the bytes took before, still taken: a UTF-8 BOM, and integers of
    MAX_DIGITS digits (a field's own bound names them)."""
    r = send(srv, CMPL, b"\xef\xbb\xbf" + cmpl(temperature="0", return_token_ids="true"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == srv.oracle(srv.tok.encode("x"), 2)
    err = api_error(send(srv, CMPL, cmpl(seed="9" * MAX_DIGITS)), 400)
    assert err["param"] == "seed" and "less than 9223372036854775808" in err["message"]


# ------------------------------------------------------------------ routes and methods
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_an_unknown_path_is_a_404_in_the_api_shape(srv: Server, method: str) -> None:
    for path in ("/v1/nope", "/", "/v1/completions/extra", "/v1/%ED%A0%80"):
        err = api_error(httpx.request(method, srv.base + path, headers=AUTH), 404)
        assert err["message"].startswith(f"no such path: {method} "), err
        assert "POST /v1/completions" in err["message"]


WRONG_METHODS = [("GET", CMPL, "POST"), ("PUT", CHAT, "POST"), ("POST", "/health", "GET"),
                 ("POST", "/metrics", "GET"), ("POST", "/state", "GET"),
                 ("DELETE", "/v1/models", "GET"), ("POST", "/openapi.json", "GET")]


@pytest.mark.parametrize(("method", "path", "allowed"), WRONG_METHODS)
def test_a_method_a_path_does_not_take_is_a_405_naming_the_one_it_does(
        srv: Server, method: str, path: str, allowed: str) -> None:
    r = httpx.request(method, srv.base + path, headers=JSON, content=b'{"\xff": [[[')
    err = api_error(r, 405)
    assert err["message"] == f"{path} does not take {method}: send {r.headers['allow']}"
    assert allowed in r.headers["allow"]


def test_the_other_errors_keep_the_api_shape(srv: Server) -> None:
    """The errors that had it already: a body that is no JSON type (413 and 401 come before the
    body is read, tests/test_serve_api_audit.py)."""
    r = httpx.post(srv.base + CMPL, content=b"x=1", headers=AUTH)
    assert "Content-Type: application/json" in api_error(r, 400)["message"]
    assert "empty" in api_error(send(srv, CMPL, b""), 400)["message"]
    assert "not a JSON array" in api_error(send(srv, CMPL, b"[1]"), 400)["message"]
    r = httpx.post(srv.base + CMPL, content=b"{}", headers={"Content-Type": "application/json"})
    assert api_error(r, 401)["code"] == "invalid_api_key"


# ------------------------------------------------------------------ afterwards
def test_afterwards_the_server_serves_exactly_and_logged_no_traceback(
        served: tuple[Server, Records]) -> None:
    """Run last in this module (pytest keeps the file's order): every bad input above went to
    this server, which still serves the real client token for token, stream and not, and
    logged nothing of an error."""
    s, rec = served
    # (each kind of input once more, whatever ran before)
    for path, body, *_ in LONE[:3] + [(CMPL, b, 0) for b, *_ in BAD_BODIES[:4]]:
        assert send(s, path, body).status_code == 400
    c = s.client()
    prompt = s.tok.encode("The quick brown fox")
    want = s.oracle(prompt, 8)
    res = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8,
                               temperature=0, extra_body={"return_token_ids": True})
    assert res.choices[0].token_ids == want
    msgs = [{"role": "user", "content": "hello"}]
    want = s.oracle(s.tok.chat(msgs), 6)
    res = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert res.choices[0].token_ids == want
    chunks = list(c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8,
                                       temperature=0, stream=True,
                                       extra_body={"return_token_ids": True}))
    assert [t for ch in chunks for choice in ch.choices for t in choice.token_ids] == \
        s.oracle(prompt, 8)
    st_ = s.wait_at_rest()
    assert all(own in ("free", "cache") for own in st_["blocks"])
    # (the server logs from its own threads; what this thread logs is the test process's own,
    # e.g. asyncio reporting an earlier test's client collected after its loop closed)
    here = threading.get_ident()
    bad = [(r.name, r.levelname, r.getMessage()) for r in rec.records if r.thread != here
           and (r.exc_info or r.levelno >= logging.ERROR or "Traceback" in r.getMessage())]
    assert not bad, bad


# ------------------------------------------------------------------ the parser alone
@given(st.binary(max_size=64))
def test_parse_body_takes_any_bytes(body: bytes) -> None:
    """Any bytes: a value or a BodyError, nothing else."""
    try:
        parse_body(body)
    except BodyError as exc:
        assert exc.message


# text with lone surrogates too (low ones only: a high one before a low one is a pair)
texts = st.text(st.characters() | st.sampled_from(["\udc00", "\udfff"]), max_size=6)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**MAX_DIGITS) + 1, 10**MAX_DIGITS - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=20)


@given(values)
def test_parse_body_gives_back_any_json_of_unicode_text(value: Any) -> None:
    """Whatever JSON the encoder writes from Unicode text, finite numbers and integers of at
    most MAX_DIGITS digits parses back to itself, escaped or not; with a lone surrogate in a
    string or a key, it is refused."""
    has_lone = any(0xD800 <= ord(ch) <= 0xDFFF for ch in json.dumps(value, ensure_ascii=False))
    if has_lone:  # (st.text draws lone surrogates too: those are refused, escaped or not)
        with pytest.raises(BodyError, match="lone surrogate"):
            parse_body(json.dumps(value).encode())
        return
    assert parse_body(json.dumps(value).encode()) == value
    assert parse_body(json.dumps(value, ensure_ascii=False).encode()) == value
