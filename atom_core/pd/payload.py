"""The KV payload of prefill/decode disaggregation, and the checks a decode worker runs on it.

In PD serving a prefill worker computes a prompt's KV and its first generated token and ships
them to a decode worker, which writes the KV into a fresh lane's block and keeps decoding from
there. `KVPayload` is what travels: the request id, the prompt, the first token, the KV of the
prompt's positions in the runtime's host layout `[layers, 2 (K, V), kv_heads, n, head_dim]`, its
dtype, the fingerprint of the model that computed it, a SHA-256 checksum and, when the workers
share a key, an HMAC-SHA256. The flow is

    prefill worker: AtomBatcher.take_export(...) (fetch_kv_cache of each of the request's
                    blocks); make_payload(...); to_wire(...)
    decode worker:  from_wire(...); validate(...); write_into(payload, buf);
                    AtomBatcher.import_kv(...) (update_kv_cache into each of its blocks)

With paged block tables (max_seq_len = T * block_size, T > 1) a prompt spans several blocks:
the payload is still the prompt's positions, so it does not depend on either side's blocks.

A hybrid (Gemma3-style) model keeps the KV of its sliding-window layers not in the blocks but in
a per-lane local window `[sliding_layers, 2, kv_heads, W, head_dim]` (as the RBLN kernel keeps
it: the last min(p, W) positions in order, oldest first), and its host buffer covers the global
layers only. Its payload also carries `local_kv`, the lane's window after prefill
(`runtime.fetch_local_cache(local, lane)`; `make_payload(..., local_host=local)`), which the
decode side writes into its lane's slot (`runtime.update_local_cache(payload.local_kv,
lane)`). Without it the decode side's sliding layers would attend to whatever its slot held:
plausible tokens, wrong ones. The window depends only on the prompt's length, so it is valid
as-is at the same length in another lane of another worker.

Once KV is in a lane's block nothing downstream can tell good KV from bad: decode attends to
whatever the block holds and produces plausible-looking tokens either way. So every check runs
before the write, and each one exists because a payload can be wrong in a way that would
otherwise go unnoticed:

- mac: an unauthenticated peer must not inject KV into a lane (it would steer the output of
  someone else's request). With a key configured, the HMAC is checked first and nothing in the
  payload is trusted before it passes. A checksum alone does not help here: anyone can recompute
  it. (The workers also run over `atom_core.pd.secure_link.SecureLink`, which encrypts and
  authenticates every message; their payload MAC key is derived from the shared key with HKDF.)

Parsing and validation are total: whatever a peer sends, `from_wire` and `validate` raise
`PayloadError` or nothing; hex digests are checked by pattern and compared as bytes in constant
time, and non-finite KV is refused. `frame_limits(config, runtime)` bounds what a peer may
announce, checked before anything is allocated.
- checksum: bytes damaged in transit (a torn write, a buggy transport) would decode as garbage.
- fingerprint: KV computed by a different model (other weights, other seed, other cache dtype)
  has the right shape and is still garbage for this one.
- request_id: a transport that mixes up requests would give one user another's context.
- length: a partial result (a prefill that died mid-prompt, a truncated transfer) must never be
  imported: decode would continue from a prompt with a hole at its end.
- prompt: the KV must be that of this request's prompt, token for token.
- first_token: a token outside the vocabulary would fail (or index out of range) at the first
  decode step, after the lane was already committed.
- shape and dtype: a different layout or cache dtype cannot be copied into the device block.
- local_kv: a hybrid decode side needs the sliding window, of exactly its local slot's
  shape and dtype; a plain one has no slot to put it in (a payload with one comes from a
  different kind of model).

The checksum and the MAC are over the same message: a version tag, the canonical JSON of the
header fields (request_id, prompt, first_token, dtype, fingerprint, shape, and local_shape when
the payload carries local_kv; sorted keys, no whitespace, ASCII), a NUL byte (which canonical
JSON never contains), and the raw bytes of the contiguous KV, then of the contiguous local_kv if
any, in the machine's byte order (little-endian on every supported host). Both shapes are in the
header, so the boundary between the two byte runs is authenticated too; a plain payload's
message is unchanged from before hybrid payloads existed (same tag, same checksum).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
import operator
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from atom_core.batcher import all_finite
from atom_core.runtime.protocol import Capabilities, capabilities, own_fingerprint

__all__ = [
    "FrameLimits",
    "KVPayload",
    "PayloadError",
    "compute_checksum",
    "compute_mac",
    "dtype_name",
    "frame_limits",
    "from_wire",
    "layout_of",
    "load_key",
    "stretch_key",
    "make_payload",
    "model_fingerprint",
    "to_wire",
    "validate",
    "write_into",
]

MIN_KEY_BYTES = 16
# The link keys are derived from the shared secret stretched with scrypt (`stretch_key`, about
# 65 ms and 32 MiB, once per process and secret): anyone who reaches a worker's port can play
# the other end of the key handshake and get one proof to test guesses at the secret against
# offline, and a secret a person chose (a passphrase) falls to a fast guess loop. A random key
# (`secrets.token_hex(32)`) needs none of this, but both are treated alike so that no one has
# to tell them apart.
_STRETCH_SALT = b"atom-core/pd-key/v2"
_STRETCH_N = 2 ** 15
_TAG = b"atom-core/pd-kv/v1\n"
_HEADER_FIELDS = ("request_id", "prompt", "first_token", "dtype", "fingerprint", "checksum",
                  "mac", "shape")


# A SHA-256 / HMAC-SHA256 digest as the header carries it: checked by this pattern before it is
# decoded, so a surrogate or a non-hex character is a malformed header, not an exception.
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}\Z")
# Bounds on the header's strings: ids and names, never data.
_MAX_ID_CHARS = 256
_MAX_NAME_CHARS = 1024


class PayloadError(ValueError):
    """One request's payload is unusable; `field` names what was wrong ("mac", "checksum",
    "fingerprint", "request_id", "length", "prompt", "first_token", "shape", "dtype",
    "local_kv", "kv", "header"). The message says what was expected, what arrived and what to
    do. Parsing and validation are total: whatever a peer sends, they raise nothing else."""

    field: str

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:
        # the default reduce would call PayloadError(message) and lose the field
        return (type(self), (self.field, str(self)))


def is_int(v: Any) -> bool:
    """A JSON integer (an int, not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _tokens(value: Iterable[Any]) -> tuple[int, ...]:
    # operator.index refuses floats: a token id 3.7 is a caller bug, not something to round
    return tuple(operator.index(t) for t in value)


def _first_token(_inst: Any, _attr: Any, value: Any) -> None:
    if not is_int(value):
        raise TypeError(f"first_token must be an int, got {type(value).__name__}")


def _opt_str(_inst: Any, _attr: Any, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"mac must be a str or None, got {type(value).__name__}")


_str = attrs.validators.instance_of(str)
_opt_tensor = attrs.validators.optional(attrs.validators.instance_of(torch.Tensor))


@attrs.frozen(eq=False)
class KVPayload:
    """The KV of one prompt, shipped from a prefill worker to a decode worker.

    `kv` is `[layers, 2 (K, V), kv_heads, n, head_dim]`: the runtime's host layout cut to the
    prompt's n positions (the global layers of a hybrid model). `dtype` is `kv`'s dtype without
    "torch.". `checksum` is the SHA-256 hex and `mac` the HMAC-SHA256 hex (or None) of the
    message in the module docstring. `local_kv` (hybrid models only, else None) is the lane's
    sliding window `[sliding_layers, 2, kv_heads, W, head_dim]`, in `kv`'s dtype.
    `eq=False`: tensors have no boolean equality.
    """

    request_id: str = attrs.field(validator=_str)
    prompt: tuple[int, ...] = attrs.field(converter=_tokens)
    first_token: int = attrs.field(validator=_first_token)
    kv: torch.Tensor = attrs.field(validator=attrs.validators.instance_of(torch.Tensor))
    dtype: str = attrs.field(validator=_str)
    fingerprint: str = attrs.field(validator=_str)
    checksum: str = attrs.field(validator=_str)
    mac: str | None = attrs.field(default=None, validator=_opt_str)
    local_kv: torch.Tensor | None = attrs.field(default=None, validator=_opt_tensor)


# --- digests -----------------------------------------------------------------------------------

def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32: the dtype as the payload names it."""
    return str(dtype).removeprefix("torch.")


def layout_of(host_buffer: torch.Tensor) -> tuple[int, int, int, int]:
    """(layers, 2, kv_heads, head_dim) of a host buffer `[layers, 2, kv_heads, block, head_dim]`
    (e.g. `runtime.new_host_buffer()`): the `layout` argument of `validate`."""
    if host_buffer.dim() != 5:
        raise ValueError(f"a host buffer is [layers, 2, kv_heads, block_size, head_dim], got "
                         f"shape {list(host_buffer.shape)}")
    layers, kv, heads, _, dim = host_buffer.shape
    return (int(layers), int(kv), int(heads), int(dim))


def _header_bytes(p: KVPayload) -> bytes:
    fields = {"request_id": p.request_id, "prompt": list(p.prompt), "first_token": p.first_token,
              "dtype": p.dtype, "fingerprint": p.fingerprint, "shape": list(p.kv.shape)}
    if p.local_kv is not None:
        # only when present: a plain payload hashes exactly as before hybrid payloads existed
        fields["local_shape"] = list(p.local_kv.shape)
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _kv_bytes(kv: torch.Tensor) -> Any:
    # A uint8 view hashes every dtype the same way (bfloat16 has no numpy type) and, being a
    # numpy array over the tensor's memory, feeds hashlib without another copy.
    return kv.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _check_key(key: Any) -> bytes:
    if not isinstance(key, bytes) or not key:
        raise TypeError("key must be non-empty bytes (see load_key)")
    return key


def _digests(p: KVPayload, key: bytes | None) -> tuple[str, str | None]:
    """(checksum, mac or None) of `p`, in one pass over the KV bytes."""
    parts = [_TAG, _header_bytes(p), b"\0", _kv_bytes(p.kv)]
    if p.local_kv is not None:
        parts.append(_kv_bytes(p.local_kv))
    sha = hashlib.sha256()
    mac = None if key is None else hmac.new(_check_key(key), digestmod=hashlib.sha256)
    for part in parts:
        sha.update(part)
        if mac is not None:
            mac.update(part)
    return sha.hexdigest(), None if mac is None else mac.hexdigest()


def compute_checksum(payload: KVPayload) -> str:
    """The SHA-256 hex `payload.checksum` must equal (ignores the stored checksum and mac)."""
    return _digests(payload, None)[0]


def compute_mac(payload: KVPayload, key: bytes) -> str:
    """The HMAC-SHA256 hex `payload.mac` must equal under `key`."""
    mac = _digests(payload, key)[1]
    assert mac is not None
    return mac


# --- model fingerprint -------------------------------------------------------------------------

def model_fingerprint(runtime: Any, caps: Capabilities | None = None) -> str:
    """A stable id of the model and KV layout `runtime` computes: KV from runtimes with
    different fingerprints must not be mixed. `caps`: the runtime's `Capabilities`, as its
    batcher read them (None: read here).

    The runtime's own `fingerprint` (a str) when it has one (`protocol.own_fingerprint`;
    `TorchReferenceRuntime` and `HFRuntime` have one; give `RblnRuntime` one with
    `fingerprint=`). Otherwise a SHA-256 over the layout facts of its capabilities (class,
    vocab_size, block_size, max_seq_len) and its host buffer's shape and dtype: that catches a
    different architecture or cache dtype but not different weights of the same architecture,
    so production workers should pass an explicit fingerprint (e.g. the hash of the compiled
    artifact).
    """
    own = own_fingerprint(runtime)
    if own is not None:
        return own
    caps = capabilities(runtime) if caps is None else caps
    host = runtime.new_host_buffer()
    facts = {"class": caps.qualname, "vocab_size": caps.vocab_size,
             "block_size": caps.block_size, "max_seq_len": caps.max_seq_len,
             "host_shape": [int(d) for d in host.shape], "host_dtype": dtype_name(host.dtype)}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


# --- limits ------------------------------------------------------------------------------------

# Header bytes beyond a prompt's token list: ids, names, digests, shapes (the strings' own bounds,
# _MAX_ID_CHARS and _MAX_NAME_CHARS, with room for JSON escapes).
_HEADER_OVERHEAD = 16 << 10


@attrs.frozen
class FrameLimits:
    """The largest message a PD peer may announce, from this side's config and runtime: a
    larger one is refused before any buffer is allocated for it. `header_bytes`: a header
    carrying a max_seq_len prompt; `tensor_bytes`: the KV of max_seq_len positions
    ([layers, 2, kv_heads, max_seq_len, head_dim] x item size) plus a hybrid model's sliding
    window ([sliding_layers, 2, kv_heads, W, head_dim])."""

    header_bytes: int
    tensor_bytes: int


def frame_limits(config: Any, runtime: Any, caps: Capabilities | None = None) -> FrameLimits:
    """`FrameLimits` of a worker running `runtime` under `config` (see there; `caps`: the
    runtime's `Capabilities`, None: read here). Raises ValueError when the runtime's host buffer
    is not the PD layout (e.g. RBLN's flat buffer)."""
    caps = capabilities(runtime) if caps is None else caps
    host = runtime.new_host_buffer()
    if host.dim() != 5:
        raise ValueError(f"PD needs a host buffer [layers, 2, kv_heads, block_size, head_dim]; "
                         f"{caps.name} gives shape {list(host.shape)}")
    layers, kv, heads, _, dim = (int(d) for d in host.shape)
    item = host.element_size()
    tensor = layers * kv * heads * int(config.max_seq_len) * dim * item
    if getattr(config, "sliding_window", None) is not None:
        local = runtime.new_local_host_buffer()
        tensor += local.numel() * local.element_size()
    vocab = 1 << 31 if caps.vocab_size is None else int(caps.vocab_size)
    # a token is at most len(str(vocab - 1)) digits and a comma
    header = int(config.max_seq_len) * (len(str(max(0, vocab - 1))) + 1) + _HEADER_OVERHEAD
    return FrameLimits(header_bytes=header, tensor_bytes=tensor)


# --- prefill side ------------------------------------------------------------------------------

def make_payload(request_id: str, prompt: Sequence[int], first_token: int,
                 host_block: torch.Tensor, fingerprint: str,
                 key: bytes | None = None, *,
                 local_host: torch.Tensor | None = None) -> KVPayload:
    """The payload of a finished prefill: `host_block` is `[layers, 2, kv_heads, positions,
    head_dim]` fetched from the request's blocks (`AtomBatcher.take_export`: one host buffer,
    or several joined along positions); positions [0, len(prompt)) are kept (a contiguous copy,
    so the buffer can be reused at once).

    Hybrid models: `local_host` is the lane's local slot `[sliding_layers, 2, kv_heads, W,
    head_dim]` (`runtime.fetch_local_cache`), shipped as `local_kv`: a copy in which only the
    window's first min(n, W) entries (positions n - min(n, W) .. n - 1, oldest first) are kept
    and every other entry is zeroed: those are what the next call (at position n) reads; the
    others hold nothing of this prompt (an earlier request's KV, which must not leave the
    worker). So `local_kv` is a function of the prompt alone, like `kv`."""
    tokens = _tokens(prompt)
    if host_block.dim() != 5 or host_block.shape[1] != 2:
        raise PayloadError("shape", f"host_block must be [layers, 2, kv_heads, positions, "
                                    f"head_dim] (AtomBatcher.take_export), got shape "
                                    f"{list(host_block.shape)}")
    n, block = len(tokens), int(host_block.shape[3])
    if not 1 <= n <= block:
        raise PayloadError("length", f"a prompt of {n} tokens cannot be shipped from a host "
                                     f"buffer of {block} positions: it must have 1..{block} "
                                     "tokens")
    kv = host_block.detach()[:, :, :, :n].cpu().clone(memory_format=torch.contiguous_format)
    local = None if local_host is None else _shipped_window(local_host, n, kv.dtype)
    unsigned = KVPayload(request_id=request_id, prompt=tokens, first_token=first_token, kv=kv,
                         dtype=dtype_name(kv.dtype), fingerprint=fingerprint, checksum="",
                         local_kv=local)
    checksum, mac = _digests(unsigned, key)
    return attrs.evolve(unsigned, checksum=checksum, mac=mac)


def _shipped_window(local_host: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The local window of a prompt of n tokens as `make_payload` ships it (see there)."""
    if not isinstance(local_host, torch.Tensor) or local_host.dim() != 5 \
            or local_host.shape[1] != 2 or local_host.shape[3] < 1:
        got = list(local_host.shape) if isinstance(local_host, torch.Tensor) else \
            type(local_host).__name__
        raise PayloadError("local_kv", f"local_host must be [sliding_layers, 2, kv_heads, "
                                       f"sliding_window, head_dim] "
                                       f"(runtime.new_local_host_buffer()), got {got}")
    if local_host.dtype != dtype:
        raise PayloadError("local_kv", f"local_host is {dtype_name(local_host.dtype)}, the KV "
                                       f"{dtype_name(dtype)}: both come from the same runtime's "
                                       "cache and must agree")
    w = int(local_host.shape[3])
    window = local_host.detach().cpu().clone(memory_format=torch.contiguous_format)
    window[:, :, :, min(n, w):] = 0
    return window


# --- decode side -------------------------------------------------------------------------------

def validate(payload: KVPayload, *, request_id: str, prompt: Sequence[int], fingerprint: str,
             layout: tuple[int, int, int, int], dtype: str, vocab_size: int | None,
             key: bytes | None = None,
             local_layout: tuple[int, int, int, int, int] | None = None) -> None:
    """Check `payload` against what this decode worker expects; raise `PayloadError` naming the
    first bad field. Authentication (when `key` is set) comes first and the payload is trusted
    for nothing before it passes, so messages before that quote the expected request id, not
    the payload's. With `key=None` a payload's mac is ignored (this side did not configure
    authentication).

    `local_layout`: None for a plain model (a payload carrying `local_kv` is refused); for a
    hybrid one the shape of its local slot, `tuple(runtime.new_local_host_buffer().shape)` =
    (sliding_layers, 2, kv_heads, W, head_dim), which `local_kv` must have exactly, in `dtype`.
    """
    expected = _tokens(prompt)
    if not expected:
        raise ValueError("validate needs the request's prompt (got an empty one)")
    layout = tuple(int(d) for d in layout)  # type: ignore[assignment]
    if len(layout) != 4:
        raise ValueError(f"layout is (layers, 2, kv_heads, head_dim), got {layout}")
    if local_layout is not None:
        local_layout = tuple(int(d) for d in local_layout)  # type: ignore[assignment]
        if len(local_layout) != 5:
            raise ValueError(f"local_layout is (sliding_layers, 2, kv_heads, sliding_window, "
                             f"head_dim), got {local_layout}")
    rid = request_id
    try:
        _validate(payload, rid, expected, fingerprint, layout, dtype, vocab_size, key,
                  local_layout)
    except PayloadError:
        raise
    except Exception as exc:  # noqa: BLE001 - total: whatever the payload holds
        raise PayloadError("header", f"the payload for request {rid!r} is malformed "
                                     f"({type(exc).__name__}): it is discarded") from None


def _digest_bytes(value: Any) -> bytes | None:
    """The digest of a header's hex string, or None when it is not 64 lowercase hex digits."""
    if not isinstance(value, str) or not _HEX_DIGEST.match(value):
        return None
    return bytes.fromhex(value)


def _validate(payload: KVPayload, rid: str, expected: tuple[int, ...], fingerprint: str,
              layout: tuple[int, ...], dtype: str, vocab_size: int | None, key: bytes | None,
              local_layout: tuple[int, ...] | None) -> None:
    if not isinstance(payload, KVPayload):
        raise PayloadError("header", f"expected a KVPayload for request {rid!r}, got "
                                     f"{type(payload).__name__}")
    checksum, mac = _digests(payload, key)
    if key is not None:
        if payload.mac is None:
            raise PayloadError("mac", f"the payload for request {rid!r} carries no MAC, but this "
                                      "decode worker requires authenticated KV: configure the "
                                      "same shared key on the prefill worker")
        assert mac is not None
        got = _digest_bytes(payload.mac)
        # constant time over the digests' bytes; a malformed mac compares against zeros
        if not hmac.compare_digest(got or bytes(32), bytes.fromhex(mac)) or got is None:
            raise PayloadError("mac", f"the payload for request {rid!r} failed authentication "
                                      "(HMAC mismatch): it was altered or signed with another "
                                      "key. It is discarded; if the sender is legitimate, give "
                                      "both workers the same shared key")
    got = _digest_bytes(payload.checksum)
    if got is None or not hmac.compare_digest(got, bytes.fromhex(checksum)):
        shown = payload.checksum[:16] if got is not None else "(not a SHA-256 hex digest)"
        raise PayloadError("checksum", f"the KV payload for request {rid!r} is corrupt: its "
                                       f"checksum is {shown!r}..., its content "
                                       f"hashes to {checksum[:16]!r}...; the transfer damaged "
                                       "it: re-run the prefill for this request")
    if payload.fingerprint != fingerprint:
        raise PayloadError("fingerprint", f"the KV for request {rid!r} was computed by model "
                                          f"{payload.fingerprint!r}, this decode worker runs "
                                          f"{fingerprint!r}: the prefill worker runs a different "
                                          "model: start both workers with the same model and "
                                          "cache dtype")
    if payload.request_id != rid:
        raise PayloadError("request_id", f"expected the KV of request {rid!r}, got request "
                                         f"{payload.request_id!r}: the transport delivered "
                                         "another request's payload; match payloads to "
                                         "requests by id")
    n = len(expected)
    if len(payload.prompt) != n:
        raise PayloadError("length", f"request {rid!r} has a prompt of {n} tokens, the payload "
                                     f"one of {len(payload.prompt)}: it is not this prompt's "
                                     "prefill; re-run the prefill for this request")
    if payload.kv.dim() == 5 and int(payload.kv.shape[3]) != n:
        raise PayloadError("length", f"the payload for request {rid!r} holds KV of "
                                     f"{int(payload.kv.shape[3])} positions for a prompt of {n} "
                                     "tokens: a partial prefill result, which must never be "
                                     "imported; re-run the prefill for this request")
    if payload.prompt != expected:
        i = next(i for i, (a, b) in enumerate(zip(payload.prompt, expected, strict=True))
                 if a != b)
        raise PayloadError("prompt", f"prompt token {i} of request {rid!r} is {expected[i]}, "
                                     f"the payload's is {payload.prompt[i]}: the KV belongs to "
                                     "a different prompt; re-run the prefill with this "
                                     "request's prompt")
    # (a runtime that does not know its vocabulary, `vocab_size` None, bounds ids below only)
    if payload.first_token < 0 or vocab_size is not None and payload.first_token >= vocab_size:
        vocab = "" if vocab_size is None else f" 0..{vocab_size - 1}"
        raise PayloadError("first_token", f"the first token of request {rid!r} is "
                                          f"{payload.first_token}, outside this model's "
                                          f"vocabulary{vocab}: the prefill worker "
                                          "runs a model with another vocabulary or sampled "
                                          "garbage; start both workers with the same model")
    shape = tuple(int(d) for d in payload.kv.shape)
    got = (*shape[:3], shape[4]) if len(shape) == 5 else None
    if got != layout:
        raise PayloadError("shape", f"the KV of request {rid!r} has shape {list(shape)}, "
                                    f"expected [layers, 2, kv_heads, n, head_dim] = "
                                    f"[{layout[0]}, {layout[1]}, {layout[2]}, {n}, {layout[3]}]: "
                                    "the workers' models differ in layers or heads; start both "
                                    "with the same model")
    kv_dtype = dtype_name(payload.kv.dtype)
    if payload.dtype != dtype or kv_dtype != dtype:
        raise PayloadError("dtype", f"the KV of request {rid!r} is {payload.dtype} (tensor: "
                                    f"{kv_dtype}), this runtime's KV cache is {dtype}: start "
                                    "both workers with the same cache dtype")
    _validate_local(payload.local_kv, rid, local_layout, dtype)
    for name, t in (("kv", payload.kv), ("local_kv", payload.local_kv)):
        # a valid checksum says only that it was sent that way (import_kv asks the same again:
        # it is the API a caller without a payload uses)
        if t is not None and not all_finite(t):
            raise PayloadError(name, f"the {name} of request {rid!r} holds non-finite values "
                                     "(NaN or inf): the prefill worker's model diverged or its "
                                     "cache is damaged; it is discarded")


def _validate_local(local: torch.Tensor | None, rid: str,
                    local_layout: tuple[int, ...] | None, dtype: str) -> None:
    if local_layout is None:
        if local is not None:
            raise PayloadError("local_kv", f"the payload for request {rid!r} carries "
                                           f"sliding-window state {list(local.shape)}, but this "
                                           "decode worker's model has no sliding-window layers: "
                                           "the prefill worker runs a hybrid model; start both "
                                           "workers with the same model")
        return
    if local is None:
        raise PayloadError("local_kv", f"the payload for request {rid!r} carries no "
                                       "sliding-window state (local_kv), and this decode "
                                       "worker's model is hybrid: its sliding layers would "
                                       "attend to whatever the lane's local slot held. The "
                                       "prefill worker must ship the lane's local window "
                                       "(make_payload(local_host=...)); upgrade it, or run the "
                                       "same model on both workers")
    shape = tuple(int(d) for d in local.shape)
    if shape != local_layout:
        raise PayloadError("local_kv", f"the sliding-window state (local_kv) of request "
                                       f"{rid!r} has shape {list(shape)}, expected "
                                       f"[sliding_layers, 2, kv_heads, sliding_window, "
                                       f"head_dim] = {list(local_layout)}: the workers' models "
                                       "differ in window or layers; start both with the same "
                                       "model")
    local_dtype = dtype_name(local.dtype)
    if local_dtype != dtype:
        raise PayloadError("local_kv", f"the sliding-window state (local_kv) of request "
                                       f"{rid!r} is {local_dtype}, this runtime's cache is "
                                       f"{dtype}: start both workers with the same cache dtype")


def write_into(payload: KVPayload, host_buffer: torch.Tensor) -> torch.Tensor:
    """Zero `host_buffer` and copy the payload's KV into its positions [0, n); returns the
    buffer, for `runtime.update_kv_cache(buffer, block)`. Call `validate` first."""
    kv = payload.kv
    if host_buffer.dim() != 5 or kv.dim() != 5 or layout_of(host_buffer) != (
            *kv.shape[:3], kv.shape[4]):
        raise PayloadError("shape", f"cannot write KV of shape {list(kv.shape)} into a host "
                                    f"buffer of shape {list(host_buffer.shape)}: they must "
                                    "agree in every dimension but positions; use "
                                    "runtime.new_host_buffer() of a runtime with the same model")
    if host_buffer.dtype != kv.dtype:
        raise PayloadError("dtype", f"cannot write {dtype_name(kv.dtype)} KV into a "
                                    f"{dtype_name(host_buffer.dtype)} host buffer: start both "
                                    "workers with the same cache dtype")
    n, block = int(kv.shape[3]), int(host_buffer.shape[3])
    if n > block:
        raise PayloadError("length", f"KV of {n} positions does not fit a host buffer of "
                                     f"{block}: give one as long as the decode worker's "
                                     "tables (max_seq_len positions)")
    # Zeros past n, not whatever the buffer held: the block then carries nothing of an earlier
    # request (another user's KV), and its content is a function of the payload alone.
    host_buffer.zero_()
    host_buffer[:, :, :, :n].copy_(kv)
    return host_buffer


# --- wire format -------------------------------------------------------------------------------

def to_wire(payload: KVPayload) -> tuple[dict[str, Any], torch.Tensor]:
    """A JSON-serializable header and one tensor, for a transport to ship (transports carry one
    tensor per message). A plain payload ships its KV tensor (not copied). One with `local_kv`
    ships a flat 1-D tensor, the KV's elements then local_kv's (a copy), with the header's
    "shape" and "local_shape" saying where to cut it."""
    header = {"request_id": payload.request_id, "prompt": list(payload.prompt),
              "first_token": payload.first_token, "dtype": payload.dtype,
              "fingerprint": payload.fingerprint, "checksum": payload.checksum,
              "mac": payload.mac, "shape": [int(d) for d in payload.kv.shape]}
    if payload.local_kv is None:
        return header, payload.kv
    local = payload.local_kv
    if local.dtype != payload.kv.dtype:
        # one tensor has one dtype; such a payload would fail validate anyway
        raise PayloadError("local_kv", f"cannot ship local_kv of dtype {dtype_name(local.dtype)} "
                                       f"with KV of dtype {dtype_name(payload.kv.dtype)}")
    header["local_shape"] = [int(d) for d in local.shape]
    return header, torch.cat([payload.kv.detach().reshape(-1), local.detach().reshape(-1)])


def from_wire(header: Mapping[str, Any], tensor: Any) -> KVPayload:
    """The payload of a received header and tensor. Checks only that the header is well formed
    (PayloadError "header") and agrees with the tensor's shape ("shape"); everything else is
    `validate`'s job. Unknown header keys are ignored: nothing outside the checksummed fields
    changes what is imported. Total: any header and any object as the tensor give a payload or
    PayloadError, never another exception."""
    try:
        return _from_wire(header, tensor)
    except PayloadError:
        raise
    except Exception as exc:  # noqa: BLE001 - total: whatever a peer sends
        raise PayloadError("header", f"the payload header is malformed ({type(exc).__name__}): "
                                     "the message is discarded") from None


def _text_ok(v: Any, limit: int) -> bool:
    """A str a header may carry: bounded, and encodable (a lone surrogate is not)."""
    if not isinstance(v, str) or len(v) > limit:
        return False
    try:
        v.encode()
    except UnicodeEncodeError:
        return False
    return True


def _dims_ok(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 5 and all(is_int(d) and d >= 0 for d in v)


def _from_wire(header: Mapping[str, Any], tensor: Any) -> KVPayload:
    if not isinstance(header, Mapping):
        raise PayloadError("header", f"the payload header must be a JSON object, got "
                                     f"{type(header).__name__}")
    missing = [k for k in _HEADER_FIELDS if k not in header]
    if missing:
        raise PayloadError("header", f"the payload header lacks {missing}: the sender speaks "
                                     "another protocol version; upgrade both workers together")
    bad = []
    for k, limit in (("request_id", _MAX_ID_CHARS), ("dtype", _MAX_ID_CHARS),
                     ("fingerprint", _MAX_NAME_CHARS)):
        if not isinstance(header[k], str):
            bad.append(f"{k} must be a string")
        elif not _text_ok(header[k], limit):
            bad.append(f"{k} must be valid text of at most {limit} characters")
    if not isinstance(header["checksum"], str):
        bad.append("checksum must be a string")
    elif not _HEX_DIGEST.match(header["checksum"]):
        bad.append("checksum must be 64 lowercase hex digits (SHA-256)")
    if not is_int(header["first_token"]):
        bad.append("first_token must be an integer")
    if header["mac"] is not None and not isinstance(header["mac"], str):
        bad.append("mac must be a string or null")
    elif header["mac"] is not None and not _HEX_DIGEST.match(header["mac"]):
        bad.append("mac must be 64 lowercase hex digits (HMAC-SHA256) or null")
    for k in ("prompt", "shape"):
        v = header[k]
        if not isinstance(v, list) or not all(is_int(t) for t in v):
            bad.append(f"{k} must be a list of integers")
    local_shape = header.get("local_shape")
    for k in ("shape",) + (("local_shape",) if local_shape is not None else ()):
        if not _dims_ok(header[k]):
            bad.append(f"{k} must be a list of 5 non-negative integers")
    if bad:
        raise PayloadError("header", "the payload header is malformed: " + "; ".join(bad))
    if not isinstance(tensor, torch.Tensor):
        raise PayloadError("shape", f"the payload's KV must be a torch.Tensor, got "
                                    f"{type(tensor).__name__}")
    kv, local = tensor, None
    if local_shape is not None:
        kv, local = _unpack(header["shape"], local_shape, tensor)
    elif list(header["shape"]) != list(tensor.shape):
        raise PayloadError("shape", f"the header announces KV of shape {header['shape']}, the "
                                    f"tensor received has shape {list(tensor.shape)}: the "
                                    "transfer was cut or mixed up; re-run the prefill")
    return KVPayload(request_id=header["request_id"], prompt=header["prompt"],
                     first_token=header["first_token"], kv=kv, dtype=header["dtype"],
                     fingerprint=header["fingerprint"], checksum=header["checksum"],
                     mac=header["mac"], local_kv=local)


def _unpack(shape: list[int], local_shape: list[int], tensor: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """KV and local_kv (views) of the flat tensor `to_wire` packs them into."""
    n_kv, n_local = math.prod(shape), math.prod(local_shape)
    if tensor.dim() != 1 or tensor.numel() != n_kv + n_local:
        raise PayloadError("shape", f"the header announces KV of shape {shape} and local_kv of "
                                    f"shape {local_shape}, packed flat: {n_kv} + {n_local} "
                                    f"elements; the tensor received has shape "
                                    f"{list(tensor.shape)}: the transfer was cut or mixed up; "
                                    "re-run the prefill")
    return tensor[:n_kv].reshape(shape), tensor[n_kv:].reshape(local_shape)


# --- shared key --------------------------------------------------------------------------------

def load_key(value: str | None) -> bytes | None:
    """The PD shared key from a CLI or environment value: None -> None (no key); "env:NAME" ->
    the environment variable NAME; "file:PATH" -> the file's content, stripped of surrounding
    whitespace; anything else -> its UTF-8 bytes. Raises ValueError for an empty value, a
    missing variable or file, a key file that group or others may read (chmod 600 it), or a
    key shorter than 16 bytes. Messages never contain the key."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError("the PD key is empty: give a key of at least 16 bytes (literal, "
                         "env:NAME or file:PATH)")
    if value.startswith("env:"):
        name = value.removeprefix("env:")
        if name not in os.environ:
            raise ValueError(f"the PD key variable {name!r} is not set: export it on both "
                             "workers, or pass the key another way")
        key, origin = os.environ[name].encode(), f"environment variable {name!r}"
    elif value.startswith("file:"):
        path = Path(value.removeprefix("file:"))
        try:
            with path.open("rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                if mode & 0o077:
                    raise ValueError(f"the PD key file {str(path)!r} is accessible by group or "
                                     f"others (mode {mode & 0o777:03o}): anyone who can read it "
                                     f"can join the link; run `chmod 600 {path}`")
                key = f.read(1 << 16).strip()
        except OSError as e:
            raise ValueError(f"cannot read the PD key file {str(path)!r}: {e.strerror or e}"
                             ) from e
        origin = f"file {str(path)!r}"
    else:
        key, origin = value.encode("utf-8", "surrogateescape"), "the given value"
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the PD key from {origin} is {len(key)} bytes; use at least "
                         f"{MIN_KEY_BYTES} (e.g. `python -c 'import secrets; "
                         "print(secrets.token_hex(32))'`)")
    return key


@functools.lru_cache(maxsize=8)
def stretch_key(secret: bytes) -> bytes:
    """The 32-byte root of every key derived from a shared secret (scrypt with a fixed salt:
    every worker given the same secret gets the same root; see _STRETCH_N for why). Cached:
    a process pays for it once per secret."""
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    return Scrypt(salt=_STRETCH_SALT, length=32, n=_STRETCH_N, r=8, p=1).derive(secret)
