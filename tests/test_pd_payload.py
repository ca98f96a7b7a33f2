"""The PD KV payload: a real prefill's KV survives the wire into another runtime's block and
decodes exactly as the oracle does, and every way a payload can be wrong is refused, naming the
field, before anything is written."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from atom_core.config import Config
from atom_core.pd.payload import (
    KVPayload,
    PayloadError,
    compute_checksum,
    compute_mac,
    dtype_name,
    from_wire,
    layout_of,
    load_key,
    make_payload,
    model_fingerprint,
    to_wire,
    validate,
    write_into,
)
from atom_core.runtime import RblnRuntime, TorchReferenceRuntime
from atom_core.runtime.protocol import RuntimeProtocolError, capabilities

C, S = 64, 256
CONFIG = Config(lanes=1, kv_blocks=1, max_seq_len=S, prefill_chunk=C)
KEY = b"k" * 32
RID = "req-7"


def runtime(seed: int = 0, dtype: torch.dtype = torch.float32, **model: Any
            ) -> TorchReferenceRuntime:
    return TorchReferenceRuntime.tiny(CONFIG, seed=seed, dtype=dtype, **model)


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(500 + seed)
    return torch.randint(0, 128, (n,), generator=g).tolist()


def prefill(rt: TorchReferenceRuntime, prompt: list[int], block: int = 0) -> int:
    """Prefill `prompt` into `block` chunk by chunk; the greedy first token."""
    bt = torch.tensor([block], dtype=torch.int16)
    logits = None
    for s in range(0, len(prompt), C):
        chunk = prompt[s:s + C]
        ids = torch.tensor([chunk + [0] * (C - len(chunk))])
        pos = torch.arange(s, s + C, dtype=torch.int32)[None]
        logits = rt.prefill(ids, pos, bt, None, torch.tensor(len(chunk) - 1, dtype=torch.int16))
    assert logits is not None
    return int(torch.argmax(logits[0, 0]))


def prefilled(rt: TorchReferenceRuntime, prompt: list[int], rid: str = RID,
              key: bytes | None = None) -> KVPayload:
    first = prefill(rt, prompt)
    host = rt.new_host_buffer()
    rt.fetch_kv_cache(host, 0)
    return make_payload(rid, prompt, first, host, model_fingerprint(rt), key=key)


def expect(rt: TorchReferenceRuntime, prompt: list[int], rid: str = RID,
           key: bytes | None = None) -> dict[str, Any]:
    """validate's keyword arguments for a decode worker running `rt`."""
    buf = rt.new_host_buffer()
    return dict(request_id=rid, prompt=prompt, fingerprint=model_fingerprint(rt),
                layout=layout_of(buf), dtype=dtype_name(buf.dtype), vocab_size=rt.vocab_size,
                key=key)


def refused(payload: KVPayload, field: str, *words: str, **kw: Any) -> PayloadError:
    with pytest.raises(PayloadError) as info:
        validate(payload, **kw)
    assert info.value.field == field, str(info.value)
    for w in words:
        assert w in str(info.value), str(info.value)
    return info.value


def resealed(p: KVPayload, key: bytes | None = None, **changes: Any) -> KVPayload:
    """`p` with `changes` and a consistent checksum (and mac under `key`): what a buggy or
    malicious sender without the right key can produce."""
    q = attrs.evolve(p, **changes)
    return attrs.evolve(q, checksum=compute_checksum(q),
                        mac=None if key is None else compute_mac(q, key))


@pytest.fixture(scope="module")
def rt0() -> TorchReferenceRuntime:
    return runtime(seed=0)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return tokens(100)


@pytest.fixture(scope="module")
def good(rt0: TorchReferenceRuntime, prompt: list[int]) -> KVPayload:
    return prefilled(rt0, prompt, key=KEY)


# --- the round trip ----------------------------------------------------------------------------

def test_real_prefill_round_trips_into_a_fresh_lane_and_decodes_like_the_oracle(
        prompt: list[int]) -> None:
    src = runtime(seed=0)
    p = prefilled(src, prompt, key=KEY)
    n = len(prompt)
    assert p.kv.shape == (2, 2, 2, n, 16) and p.kv.is_contiguous() and p.dtype == "float32"
    assert p.first_token == src.generate(prompt, 1)[0]

    header, tensor = to_wire(p)
    header = json.loads(json.dumps(header))        # the header really is JSON
    q = from_wire(header, tensor.clone())
    dst = runtime(seed=0)
    validate(q, **expect(dst, prompt, key=KEY))

    # the decode worker's only block holds an earlier request's KV: none of it may survive
    prefill(dst, tokens(200, seed=9))
    buf = write_into(q, dst.new_host_buffer())
    dst.update_kv_cache(buf, 0)
    block = dst.read_block(0)
    assert torch.equal(block[:, :, :, :n], src.read_block(0)[:, :, :, :n])
    assert not block[:, :, :, n:].any()

    # the imported KV is the real thing: the next decode step matches the cache-free oracle
    logits = dst.decode(torch.tensor([[q.first_token]]), torch.tensor([[n]], dtype=torch.int32),
                        torch.tensor([[0]], dtype=torch.int16), None)
    assert torch.equal(logits[0, 0], dst.oracle_logits([*prompt, q.first_token]))
    assert int(torch.argmax(logits[0, 0])) == src.generate(prompt, 2)[1]


def test_payload_does_not_alias_the_host_buffer(rt0: TorchReferenceRuntime) -> None:
    host = rt0.new_host_buffer()
    host.normal_(generator=torch.Generator().manual_seed(3))
    p = make_payload(RID, [1] * 256, 5, host, "m")     # the whole block: a view would suffice
    before = p.kv.clone()
    host.zero_()
    assert torch.equal(p.kv, before)
    validate(p, request_id=RID, prompt=[1] * 256, fingerprint="m", layout=layout_of(host),
             dtype="float32", vocab_size=128)


def test_fingerprints_agree_for_the_same_model_and_differ_otherwise() -> None:
    a = model_fingerprint(runtime(seed=0))
    assert a == model_fingerprint(runtime(seed=0)) == runtime(seed=0).fingerprint
    assert len(a) == 64 and int(a, 16) >= 0
    assert model_fingerprint(runtime(seed=1)) != a
    assert model_fingerprint(runtime(seed=0, dtype=torch.float64)) != a
    assert model_fingerprint(runtime(seed=0, kv_heads=4)) != a
    # the artifact's sizes are not the model: PD workers are sized differently on purpose
    wide = TorchReferenceRuntime.tiny(Config(lanes=3, kv_blocks=3, max_seq_len=512,
                                             prefill_chunk=128), seed=0)
    assert model_fingerprint(wide) == a


def test_fingerprint_is_the_same_in_another_process() -> None:
    code = ("from atom_core.config import Config\n"
            "from atom_core.runtime import TorchReferenceRuntime as R\n"
            "c = Config(lanes=1, kv_blocks=1, max_seq_len=256, prefill_chunk=64)\n"
            "print(R.tiny(c, seed=0).fingerprint)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, env=os.environ | {"PYTHONHASHSEED": "123"}).stdout.strip()
    assert out == runtime(seed=0).fingerprint


def test_fingerprint_of_other_runtimes() -> None:
    rbln = RblnRuntime(prefill=object(), decoders={1: object()}, num_blocks=2, block_size=S,
                       max_seq_len=S, prefill_chunk=C, vocab_size=128, fingerprint="llama-3b@v2")
    assert model_fingerprint(rbln) == "llama-3b@v2"
    with pytest.raises(ValueError, match="fingerprint"):
        RblnRuntime(prefill=object(), decoders={1: object()}, num_blocks=2, block_size=S,
                    max_seq_len=S, prefill_chunk=C, vocab_size=128, fingerprint="")

    class Bare(TorchReferenceRuntime):  # no fingerprint: the layout facts only
        fingerprint = None

    def bare(vocab_size: int = 128, dtype: torch.dtype = torch.float32, seed: int = 0) -> Bare:
        return Bare.tiny(CONFIG, seed=seed, dtype=dtype, vocab_size=vocab_size)

    base = model_fingerprint(bare())
    # read from the capabilities (the batcher's record), never the runtime's attributes again
    assert base == model_fingerprint(bare(), capabilities(bare()))
    assert base == model_fingerprint(bare(seed=1))  # (weights are not layout facts)
    assert base != model_fingerprint(bare(vocab_size=256))
    assert base != model_fingerprint(bare(dtype=torch.float64))
    # the class is a fact: another runtime class with the same layout is another model
    assert base != model_fingerprint(bare(), attrs.evolve(capabilities(bare()), qualname="x.Y"))

    class Odd(Bare):
        fingerprint = ""  # type: ignore[assignment]

    with pytest.raises(RuntimeProtocolError, match=r"^Odd\.fingerprint must be a non-empty str"):
        model_fingerprint(Odd.tiny(CONFIG))


# --- one refusal per field ---------------------------------------------------------------------

def test_wrong_model_is_refused(prompt: list[int]) -> None:
    p = prefilled(runtime(seed=1), prompt)
    refused(p, "fingerprint", "different model", "same model", **expect(runtime(seed=0), prompt))


def test_wrong_request_is_refused(rt0: TorchReferenceRuntime, prompt: list[int],
                                  good: KVPayload) -> None:
    e = refused(good, "request_id", "'req-8'", "'req-7'",
                **expect(rt0, prompt, rid="req-8", key=KEY))
    assert "another request" in str(e)


def test_partial_kv_is_refused(rt0: TorchReferenceRuntime, prompt: list[int],
                               good: KVPayload) -> None:
    # the prefill died after its first chunk: 64 positions of KV for a 100-token prompt
    partial = resealed(good, KEY, kv=good.kv[:, :, :, :64].contiguous())
    refused(partial, "length", "64 positions", "100 tokens", "partial", "never be imported",
            **expect(rt0, prompt, key=KEY))


def test_prompt_length_mismatch_is_refused(rt0: TorchReferenceRuntime, prompt: list[int],
                                           good: KVPayload) -> None:
    refused(good, "length", "101 tokens", "100", **expect(rt0, [*prompt, 3], key=KEY))
    short = make_payload(RID, prompt[:99], good.first_token, rt0.new_host_buffer(),
                         good.fingerprint)
    refused(short, "length", "99", **expect(rt0, prompt))


def test_prompt_token_mismatch_is_refused(rt0: TorchReferenceRuntime, prompt: list[int],
                                          good: KVPayload) -> None:
    other = list(prompt)
    other[41] = (other[41] + 1) % 128
    e = refused(good, "prompt", "token 41", "different prompt", **expect(rt0, other, key=KEY))
    assert str(other[41]) in str(e) and str(prompt[41]) in str(e)


@pytest.mark.parametrize("token", [-1, 128, 10**6])
def test_first_token_outside_the_vocabulary_is_refused(
        rt0: TorchReferenceRuntime, prompt: list[int], good: KVPayload, token: int) -> None:
    bad = resealed(good, KEY, first_token=token)
    refused(bad, "first_token", str(token), "0..127", **expect(rt0, prompt, key=KEY))


def test_a_runtime_without_a_vocabulary_bounds_the_first_token_below_only(
        rt0: TorchReferenceRuntime, prompt: list[int], good: KVPayload) -> None:
    # (Capabilities.vocab_size None: the runtime does not know its vocabulary)
    unknown = expect(rt0, prompt, key=KEY) | {"vocab_size": None}
    validate(resealed(good, KEY, first_token=10**6), **unknown)
    refused(resealed(good, KEY, first_token=-1), "first_token", "-1", **unknown)


def test_wrong_kv_layout_is_refused(rt0: TorchReferenceRuntime, prompt: list[int]) -> None:
    # a model with 4 KV heads, under a fingerprint the decode worker believes is its own
    wide = runtime(seed=0, kv_heads=4)
    prefill(wide, prompt)
    host = wide.new_host_buffer()
    wide.fetch_kv_cache(host, 0)
    p = make_payload(RID, prompt, 3, host, model_fingerprint(rt0))
    refused(p, "shape", "[2, 2, 4, 100, 16]", "[2, 2, 2, 100, 16]", **expect(rt0, prompt))


def test_wrong_dtype_is_refused(rt0: TorchReferenceRuntime, prompt: list[int]) -> None:
    wide = runtime(seed=0, dtype=torch.float64)
    p = prefilled(wide, prompt)
    kw = expect(rt0, prompt) | {"fingerprint": p.fingerprint}
    refused(p, "dtype", "float64", "float32", "same cache dtype", **kw)
    # a header that lies about its tensor's dtype
    liar = resealed(p, dtype="float32")
    refused(liar, "dtype", "tensor: float64", **kw)


def test_one_changed_element_fails_the_checksum(rt0: TorchReferenceRuntime,
                                                prompt: list[int], good: KVPayload) -> None:
    kv = good.kv.clone()
    kv[1, 1, 0, 57, 3] += 2.0**-8
    damaged = attrs.evolve(good, kv=kv)
    refused(damaged, "checksum", "corrupt", "re-run the prefill", **expect(rt0, prompt))
    # header fields are covered too
    refused(attrs.evolve(good, first_token=(good.first_token + 1) % 128), "checksum",
            **expect(rt0, prompt))
    last = (prompt[-1] + 1) % 128
    refused(attrs.evolve(good, prompt=(*good.prompt[:-1], last)), "checksum",
            **expect(rt0, [*prompt[:-1], last]))
    # with a key, the same damage is an authentication failure: it is checked first
    refused(damaged, "mac", "failed authentication", **expect(rt0, prompt, key=KEY))


def test_recomputed_checksum_does_not_fool_an_authenticating_worker(
        rt0: TorchReferenceRuntime, prompt: list[int], good: KVPayload) -> None:
    kv = good.kv.clone()
    kv[0, 0, 1, 10] = 0.5
    unsigned = resealed(good, None, kv=kv)
    refused(unsigned, "mac", "no MAC", "same shared key", **expect(rt0, prompt, key=KEY))
    forged = resealed(good, b"x" * 32, kv=kv)
    refused(forged, "mac", "HMAC mismatch", **expect(rt0, prompt, key=KEY))
    # a worker that configured no key cannot tell: that is what the key is for
    validate(forged, **expect(rt0, prompt))
    # and an honest payload passes with the key
    validate(good, **expect(rt0, prompt, key=KEY))


def test_authentication_comes_before_everything(rt0: TorchReferenceRuntime,
                                                prompt: list[int], good: KVPayload) -> None:
    # wrong in every other field too, but unauthenticated: only "mac" is reported, and the
    # message quotes the expected request id, not the payload's
    bad = resealed(good, b"x" * 32, request_id="evil", first_token=-5,
                   fingerprint="someone else's")
    e = refused(bad, "mac", **expect(rt0, prompt, key=KEY))
    assert "evil" not in str(e) and RID in str(e)
    # without a key the order is checksum, fingerprint, request id, ...
    refused(bad, "fingerprint", **expect(rt0, prompt))


def test_write_into_refuses_a_buffer_of_another_layout(good: KVPayload) -> None:
    with pytest.raises(PayloadError) as e:
        write_into(good, torch.zeros((2, 2, 4, S, 16)))
    assert e.value.field == "shape"
    with pytest.raises(PayloadError) as e:
        write_into(good, torch.zeros((2, 2, 2, S, 16), dtype=torch.float64))
    assert e.value.field == "dtype"
    with pytest.raises(PayloadError) as e:
        write_into(good, torch.zeros((2, 2, 2, 64, 16)))
    assert e.value.field == "length" and "100 positions" in str(e.value)


def test_make_payload_refuses_what_cannot_be_shipped(rt0: TorchReferenceRuntime) -> None:
    host = rt0.new_host_buffer()
    for prompt in ([], [1] * (S + 1)):
        with pytest.raises(PayloadError) as e:
            make_payload(RID, prompt, 0, host, "m")
        assert e.value.field == "length"
    with pytest.raises(PayloadError) as e:
        make_payload(RID, [1], 0, host[0], "m")
    assert e.value.field == "shape"
    with pytest.raises(TypeError):
        make_payload(RID, [1.5], 0, host, "m")


def test_other_kv_dtypes_hash_without_crashing() -> None:
    host = torch.randn((1, 2, 1, 8, 4), generator=torch.Generator().manual_seed(0))
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        p = make_payload(RID, [1, 2, 3], 4, host.to(dt), "m", key=KEY)
        assert p.dtype == dtype_name(dt)
        validate(p, request_id=RID, prompt=[1, 2, 3], fingerprint="m", layout=(1, 2, 1, 4),
                 dtype=p.dtype, vocab_size=8, key=KEY)
        kv = p.kv.clone()
        kv[0, 1, 0, 2, 0] = -kv[0, 1, 0, 2, 0] - 1
        with pytest.raises(PayloadError, match="corrupt"):
            validate(attrs.evolve(p, kv=kv), request_id=RID, prompt=[1, 2, 3], fingerprint="m",
                     layout=(1, 2, 1, 4), dtype=p.dtype, vocab_size=8)


# --- the wire ----------------------------------------------------------------------------------

@pytest.mark.parametrize("change, what", [
    (lambda h: h.pop("checksum"), "lacks ['checksum']"),
    (lambda h: h.pop("mac"), "lacks ['mac']"),
    (lambda h: h.update(prompt="1 2 3"), "prompt must be a list of integers"),
    (lambda h: h.update(prompt=[1, 2.0]), "prompt must be a list of integers"),
    (lambda h: h.update(first_token="7"), "first_token must be an integer"),
    (lambda h: h.update(first_token=True), "first_token must be an integer"),
    (lambda h: h.update(request_id=7), "request_id must be a string"),
    (lambda h: h.update(mac=123), "mac must be a string or null"),
    (lambda h: h.update(shape=None), "shape must be a list of integers"),
])
def test_malformed_headers_are_refused(good: KVPayload, change: Any, what: str) -> None:
    header, tensor = to_wire(good)
    change(header)
    with pytest.raises(PayloadError) as e:
        from_wire(header, tensor)
    assert e.value.field == "header" and what in str(e.value)


def test_wire_refuses_non_objects_and_cut_tensors(good: KVPayload) -> None:
    header, tensor = to_wire(good)
    with pytest.raises(PayloadError) as e:
        from_wire([header], tensor)  # type: ignore[arg-type]
    assert e.value.field == "header"
    with pytest.raises(PayloadError) as e:
        from_wire(header, tensor[:, :, :, :50])
    assert e.value.field == "shape" and "[2, 2, 2, 50, 16]" in str(e.value)
    with pytest.raises(PayloadError) as e:
        from_wire(header, tensor.tolist())  # type: ignore[arg-type]
    assert e.value.field == "shape"
    # unknown keys are ignored; the payload is unchanged
    q = from_wire(header | {"trace_id": "abc"}, tensor)
    assert q.checksum == good.checksum and q.mac == good.mac and q.prompt == good.prompt


def test_payload_error_pickles_with_its_field() -> None:
    e = pickle.loads(pickle.dumps(PayloadError("length", "partial")))
    assert isinstance(e, PayloadError) and e.field == "length" and str(e) == "partial"


# --- the key -----------------------------------------------------------------------------------

def test_load_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert load_key(None) is None
    with pytest.raises(ValueError, match="empty"):
        load_key("")
    assert load_key("a-literal-key-of-24-byte") == b"a-literal-key-of-24-byte"
    monkeypatch.setenv("PD_KEY_TEST", "0123456789abcdef0123")
    assert load_key("env:PD_KEY_TEST") == b"0123456789abcdef0123"
    f = tmp_path / "key"
    f.write_text("  fedcba9876543210fedcba  \n")
    f.chmod(0o600)
    assert load_key(f"file:{f}") == b"fedcba9876543210fedcba"
    for mode in (0o640, 0o604, 0o620):  # group or others may read (or write) it: refused
        f.chmod(mode)
        with pytest.raises(ValueError, match=f"mode {mode:03o}.*chmod 600") as e:
            load_key(f"file:{f}")
        assert "fedcba" not in str(e.value)
    f.chmod(0o400)
    assert load_key(f"file:{f}") == b"fedcba9876543210fedcba"
    f.chmod(0o600)

    monkeypatch.delenv("PD_KEY_MISSING", raising=False)
    with pytest.raises(ValueError, match="'PD_KEY_MISSING' is not set"):
        load_key("env:PD_KEY_MISSING")
    with pytest.raises(ValueError, match="cannot read the PD key file"):
        load_key(f"file:{tmp_path / 'nope'}")
    monkeypatch.setenv("PD_KEY_TEST", "short-secret")
    with pytest.raises(ValueError, match="12 bytes; use at least 16") as e:
        load_key("env:PD_KEY_TEST")
    assert "short-secret" not in str(e.value)     # a message must not leak the key
    f.write_text("\n")
    with pytest.raises(ValueError, match="0 bytes"):
        load_key(f"file:{f}")
    with pytest.raises(ValueError, match="15 bytes"):
        load_key("x" * 15)


def test_pd_needs_no_z3_or_hypothesis_and_the_core_no_torch() -> None:
    code = "import atom_core.pd.payload\nimport sys; print(' '.join(sys.modules))"
    mods = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                              text=True).stdout.split())
    assert "torch" in mods and not {"z3", "hypothesis"} & mods
    code = "import atom_core\nimport sys; print(' '.join(sys.modules))"
    mods = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                              text=True).stdout.split())
    assert not {"torch", "atom_core.pd.payload"} & mods
