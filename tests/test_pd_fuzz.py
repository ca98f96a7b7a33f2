"""Total parsing of what a PD peer sends: random bytes, mutated valid frames, lone surrogates and
huge declared sizes give an accepted message or `PayloadError` (the transport's header parser:
a dict or its protocol error), never another exception; a worker fed junk keeps serving every
request the junk does not name."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_core.config import Config
from atom_core.demo import oracle_for
from atom_core.pd import payload as pd
from atom_core.pd.transport import InProcessTransport, _ProtocolError, parse_header
from atom_core.pd.workers import DecodeWorker, PrefillWorker
from atom_core.runtime.reference import TorchReferenceRuntime

S, C = 128, 64
CONFIG = Config(lanes=2, kv_blocks=3, max_seq_len=S, prefill_chunk=C)
RT = TorchReferenceRuntime.tiny(CONFIG, seed=0)
FP = pd.model_fingerprint(RT)
PROMPT = list(range(1, 11))


def _good() -> pd.KVPayload:
    host = RT.new_host_buffer()
    host.normal_(generator=torch.Generator().manual_seed(0))
    return pd.make_payload("7", PROMPT, 3, host, FP)


GOOD = _good()
GOOD_HEADER, GOOD_TENSOR = pd.to_wire(GOOD)
BUF = RT.new_host_buffer()
EXPECT = dict(request_id="7", prompt=PROMPT, fingerprint=FP, layout=pd.layout_of(BUF),
              dtype=pd.dtype_name(BUF.dtype), vocab_size=RT.vocab_size)

# every code point, lone surrogates included (st.text() leaves them out)
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                      st.floats(allow_nan=True), any_text)
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(any_text, inner, max_size=4)), max_leaves=12)
huge = st.integers(2 ** 31, 2 ** 62)
dims = st.lists(st.one_of(st.integers(-3, 40), huge, json_leaf), max_size=7)


@st.composite
def mutated_header(draw: Any) -> dict[str, Any]:
    h = dict(GOOD_HEADER)
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from([*h, "local_shape", "extra"]))
        action = draw(st.sampled_from(["value", "dims", "drop"]))
        if action == "drop":
            h.pop(field, None)
        else:
            h[field] = draw(dims if action == "dims" else json_value)
    return h


tensors = st.one_of(
    st.just(GOOD_TENSOR),
    st.builds(lambda n: torch.zeros(n), st.integers(0, 64)),
    st.builds(lambda t: t.reshape(-1), st.just(GOOD_TENSOR)),
    st.builds(lambda t: t.to(torch.float16), st.just(GOOD_TENSOR)),
    st.builds(lambda t: t.clone().fill_(float("nan")), st.just(GOOD_TENSOR)),
    json_value,
)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(header=st.one_of(mutated_header(), json_value), tensor=tensors)
def test_payload_parsing_is_total(header: Any, tensor: Any) -> None:
    try:
        p = pd.from_wire(header, tensor)
        pd.validate(p, **EXPECT)
    except pd.PayloadError as exc:
        assert exc.field and str(exc)
        str(exc).encode()  # the message itself is printable text


def test_the_reported_crashes_are_payload_errors() -> None:
    for field in ("mac", "checksum"):
        with pytest.raises(pd.PayloadError) as e:
            pd.validate(pd.from_wire(GOOD_HEADER | {field: "\ud800"}, GOOD_TENSOR), **EXPECT,
                        key=b"k" * 32)
        assert e.value.field == "header" and f"{field} must be" in str(e.value)
    # built by hand, past from_wire: validate alone is total too
    for field, key in (("mac", b"k" * 32), ("checksum", None)):
        with pytest.raises(pd.PayloadError) as e:
            pd.validate(attrs.evolve(GOOD, **{field: "\ud800"}), **EXPECT, key=key)
        assert e.value.field == field
    nan = GOOD.kv.clone()
    nan[0, 0, 0, 0, 0] = float("inf")
    p = pd.make_payload("7", PROMPT, 3, torch.nn.functional.pad(nan, (0, 0, 0, S - 10)), FP)
    with pytest.raises(pd.PayloadError) as e:
        pd.validate(p, **EXPECT)
    assert e.value.field == "kv" and "non-finite" in str(e.value)


@given(raw=st.one_of(st.binary(max_size=64),
                     any_text.map(lambda t: json.dumps({"kind": t}).encode()),
                     json_value.map(lambda v: json.dumps(v).encode()),
                     st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n)))
def test_header_parsing_is_total(raw: bytes) -> None:
    try:
        h = parse_header(raw)
    except _ProtocolError:
        return
    assert isinstance(h, dict)
    json.dumps(h, ensure_ascii=False).encode()  # what a handler reads is valid text


class Junk:
    """An in-process end whose poll also hands over `junk` (what a peer could send), one
    message per poll, interleaved with the real traffic."""

    def __init__(self, inner: InProcessTransport, junk: list[dict[str, Any]],
                 after: int = 0) -> None:
        self.inner, self.junk, self.after = inner, list(junk), after

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def alive(self) -> bool:
        return self.inner.alive

    def poll(self) -> list[Any]:
        self.after -= 1
        extra = [(self.junk.pop(0), None)] if self.junk and self.after < 0 else []
        return extra + self.inner.poll()


control = st.fixed_dictionaries(
    {"kind": st.sampled_from(["kv", "prefill_failed", "prefill", "cancel", "shutdown!",
                              "nonsense"]) | any_text},
    optional={"id": json_value, "request_id": json_value, "prompt": json_value,
              "error": json_value, "shape": dims, "checksum": json_value, "mac": json_value})


@settings(max_examples=15, suppress_health_check=[HealthCheck.too_slow])
@given(to_decode=st.lists(control, max_size=6), to_prefill=st.lists(control, max_size=6))
def test_workers_fed_junk_keep_serving(to_decode: list[dict[str, Any]],
                                       to_prefill: list[dict[str, Any]]) -> None:
    td, tp = InProcessTransport.pair()
    pw = PrefillWorker(CONFIG, RT, Junk(tp, to_prefill), insecure=True)
    dw = DecodeWorker(CONFIG, RT, Junk(td, to_decode), insecure=True)
    prompts = [[5, 6, 7], [9] * 20, list(range(30, 60))]
    wids = [dw.submit(p, 4) for p in prompts]
    for _ in range(400):
        if not dw.busy():
            break
        dw.step()
        pw.step_once()
    assert not dw.busy()
    # junk may name a request (an unauthenticated link: insecure) and fail it; the others are
    # served exactly
    named = {str(v) for m in to_decode + to_prefill for k, v in m.items()
             if k in ("id", "request_id")}
    oracle = oracle_for(RT)
    for w, p in zip(wids, prompts, strict=True):
        r = dw.results()[w]
        if str(w) not in named and not any(m.get("kind") == "shutdown" for m in to_prefill):
            assert r.error is None, r.error
            assert r.tokens == oracle.generate(p, 4)


sealed = st.fixed_dictionaries(
    {"kind": st.just("sealed") | any_text},
    optional={"k": st.sampled_from(["kv", "prefill", "cancel", "peer_lost", "bye"]) | any_text,
              "rn": any_text | st.just("0" * 32), "seq": st.integers(-5, 2 ** 64) | json_value,
              "error": json_value})


@settings(max_examples=10, suppress_health_check=[HealthCheck.too_slow])
@given(to_decode=st.lists(control | sealed, max_size=5),
       to_prefill=st.lists(control | sealed, max_size=5))
def test_keyed_workers_fed_junk_on_the_wire_serve_everything(
        to_decode: list[dict[str, Any]], to_prefill: list[dict[str, Any]]) -> None:
    """With a key, junk on the wire after the handshake (what someone on the path could
    inject) never reaches a worker: the link drops it, and every request is served exactly."""
    key = b"fuzz-key-0123456789abcdef"
    td, tp = InProcessTransport.pair()
    pw = PrefillWorker(CONFIG, RT, Junk(tp, to_prefill, after=2), key=key)
    dw = DecodeWorker(CONFIG, RT, Junk(td, to_decode, after=2), key=key)
    prompts = [[5, 6, 7], [9] * 20, list(range(30, 60))]
    wids = [dw.submit(p, 4) for p in prompts]
    for _ in range(400):
        if not dw.busy():
            break
        dw.step()
        pw.step_once()
    oracle = oracle_for(RT)
    for w, p in zip(wids, prompts, strict=True):
        r = dw.results()[w]
        assert r.error is None and r.tokens == oracle.generate(p, 4), r
    assert dw.bad_messages == dw.misdirected == dw.stale_messages == 0
    assert sum(dw.transport.dropped.values()) == len(to_decode)
    assert sum(pw.transport.dropped.values()) == len(to_prefill)
