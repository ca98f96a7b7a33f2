"""Hybrid (Gemma3-style) models: sliding-window layers whose KV lives in a per-lane local window
next to the global layers' blocks.

- Colocated serving is token-exact against the oracle (`runtime.generate`, memoised) for 1..3
  lanes, both scratch modes and windows below, equal to and above the prefill chunk, with prompts
  of 1..200 tokens, varied output lengths (so padding rows occur) and random aborts; the core's
  invariants (ghost ones included) are checked after every step.
- Config and runtime agreement: the window must be a positive int, and a batcher refuses a
  runtime whose window differs from its config's (the prefix cache with a window:
  tests/test_hybrid_prefix.py).
- PD: the payload carries the prefill lane's local window (`local_kv`), covered by checksum and MAC
  and packed into the one wire tensor. A prefill batcher feeding a decode batcher is token-exact,
  also while an import is held and while an export waits (their padding rows write an idle
  lane's slot, never theirs; with no idle lane decode waits for the transfer). A
  payload without the window, or with a wrong one, fails only its request; a plain payload is
  refused by a hybrid decode side and vice versa. Over PD workers and an in-process transport,
  outputs equal the oracle.
- Why the window must travel: importing the global KV alone (the local slot zero or holding another
  prompt's window) decodes differently from the oracle for a prompt longer than the window.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import pytest
import torch

from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config, ConfigError, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.pd import payload as pd
from atom_core.pd.transport import InProcessTransport
from atom_core.pd.workers import DecodeWorker, PrefillWorker
from atom_core.policy import Policy
from atom_core.runtime import TorchReferenceRuntime
from tests.test_pd_workers import Rig

S, C, V = 256, 64, 128
# three layers, the third global: two sliding layers and one global one
MODEL = {"layers": 3, "global_every": 3}
KEY = b"hybrid-pd-key-0123456789abcdef"


def config(lanes: int, window: int | None, scratch: str = "dynamic", extra: int = 0,
           seq_len: int = S) -> Config:
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, False, scratch) + extra,
                  max_seq_len=seq_len, prefill_chunk=C, scratch=scratch,
                  sliding_window=window)


def runtime(cfg: Config, window: int | None = -1, seed: int = 0) -> TorchReferenceRuntime:
    """The reference runtime of `cfg` (its window unless `window` is given; None: plain)."""
    w = cfg.sliding_window if window == -1 else window
    model = {"sliding_window": w, **MODEL} if w is not None else {"layers": 3}
    return TorchReferenceRuntime.tiny(cfg, seed=seed, **model)


def batcher(cfg: Config, rt: TorchReferenceRuntime | None = None) -> AtomBatcher:
    return AtomBatcher(cfg, rt if rt is not None else runtime(cfg), ghost=True)


def checked_step(b: AtomBatcher) -> list[Event]:
    events = b.step()
    b.check_invariants()
    return events


def oracle(b: AtomBatcher, rid: int) -> list[int]:
    r = b.requests[rid]
    return oracle_for(b.runtime).generate(r.prompt, r.max_new_tokens, r.eos_token_id)


def assert_exact(b: AtomBatcher, rids: Iterable[int]) -> None:
    for rid in rids:
        r = b.requests[rid]
        assert r.ended and r.error is None, (rid, r.error)
        assert r.tokens == oracle(b, rid), (rid, len(r.prompt))


def assert_idle(b: AtomBatcher) -> None:
    assert not b.busy() and b.transfers() == {}
    owners = core.describe_state(b.state)["owner"]
    assert set(owners) <= {"FREE", "CACHE", "SCRATCH"}, owners
    b.check_invariants()


def prompt_of(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(V) for _ in range(n)]


# --------------------------------------------------------------------------- colocated
def workload(window: int, seed: int) -> list[tuple[list[int], int]]:
    """Prompts of 1..200 tokens around the window and chunk edges, plus random ones, each with
    its max_new_tokens (1..24: lanes finish at different steps, so padding rows occur)."""
    rng = random.Random(seed)
    lengths = sorted({1, 2, window - 1, window, window + 1, 63, 64, 65, 129, 200} - {0})
    lengths += [rng.randint(1, 200) for _ in range(3)]
    rng.shuffle(lengths)
    return [(prompt_of(n, rng), rng.randint(1, 24)) for n in lengths]


@pytest.mark.parametrize("window", [16, 64, 100], ids=["W<C", "W=C", "W>C"])
@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_colocated_token_exact(lanes: int, scratch: str, window: int) -> None:
    cfg = config(lanes, window, scratch)
    b = batcher(cfg)
    work = workload(window, seed=window)  # the same prompts per window: the oracle memo hits
    rids = [b.submit(p, n) for p, n in work]
    rng = random.Random(f"{lanes}-{scratch}-{window}")
    # three aborts at random steps, of a request holding a lane (prefilling or decoding: its
    # slot is left with a partial window the lane's next request must not see) when there is one
    abort_at = set(rng.sample(range(1, 50), 3))
    aborted: set[int] = set()
    steps = 0
    while b.busy():
        checked_step(b)
        steps += 1
        if steps in abort_at:
            live = [r for r in rids if not b.requests[r].ended]
            running = [r for r in live if b.state.phase.get(r) != core.PHASE_WAITING]
            victim = rng.choice(running or live)
            assert b.abort(victim)
            b.check_invariants()
            aborted.add(victim)
        assert steps < 5000
    assert len(aborted) == 3
    for rid in rids:
        r, want = b.requests[rid], oracle(b, rid)
        if rid in aborted:
            assert r.error == "aborted" and r.tokens == want[:len(r.tokens)], rid
        else:
            assert r.error is None and r.tokens == want, (rid, len(r.prompt))
    if lanes > 1:
        assert b.stats.decode_rows_padding > 0
    assert_idle(b)


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("bad", [0, -3, True, 1.5, "16", 16.0])
def test_sliding_window_must_be_a_positive_int(bad: Any) -> None:
    with pytest.raises(ConfigError, match="sliding_window must be a positive integer"):
        Config(lanes=1, kv_blocks=1, max_seq_len=S, prefill_chunk=C, sliding_window=bad)


@pytest.mark.parametrize("cfg_window,rt_window,why", [
    (None, 16, "runtime has sliding-window layers"),
    (16, None, "runtime has none"),
    (16, 32, "sliding_window: config 16, runtime 32"),
], ids=["hybrid-runtime-plain-config", "plain-runtime-hybrid-config", "other-window"])
def test_batcher_refuses_a_runtime_with_another_window(cfg_window: int | None,
                                                       rt_window: int | None, why: str) -> None:
    cfg = config(2, cfg_window)
    rt = runtime(cfg, window=rt_window)
    with pytest.raises(ValueError) as e:
        AtomBatcher(cfg, rt)
    msg = str(e.value)
    assert why in msg and "build the Config from the compiled artifact's settings" in msg


# --------------------------------------------------------------------------- payloads
def exported(window: int, n: int, seed: int = 0) -> tuple[TorchReferenceRuntime, pd.KVPayload]:
    """A prefill batcher's export of a prompt of n tokens, packed (unsigned)."""
    cfg = config(1, window)
    p = batcher(cfg)
    prompt = prompt_of(n, random.Random(seed))
    x = p.submit(prompt, 1, export=True)
    while x not in p.transfers():
        checked_step(p)
    exp = p.take_export(x)
    assert exp.local_host is not None
    payload = pd.make_payload("r", exp.prompt, exp.first_token, exp.host,
                              pd.model_fingerprint(p.runtime), local_host=exp.local_host)
    assert p.export_done(x) == [Event("finished", x)]
    return p.runtime, payload


def check(payload: pd.KVPayload, rt: TorchReferenceRuntime, *, key: bytes | None = None,
          hybrid: bool = True, fingerprint: str | None = None) -> None:
    pd.validate(payload, request_id=payload.request_id, prompt=payload.prompt,
                fingerprint=fingerprint or pd.model_fingerprint(rt),
                layout=pd.layout_of(rt.new_host_buffer()), dtype=pd.dtype_name(rt.dtype),
                vocab_size=rt.vocab_size, key=key,
                local_layout=tuple(rt.new_local_host_buffer().shape) if hybrid else None)


@pytest.mark.parametrize("n", [5, 16, 40])
def test_shipped_window_keeps_exactly_the_positions_later_windows_read(n: int) -> None:
    """local_kv holds positions n - min(n, W) .. n - 1 at indices 0.., as prefill left them (the
    kernel's window), and zeros elsewhere: nothing of an earlier request in that lane leaves
    the worker."""
    w = 16
    cfg = config(1, w)
    rt = runtime(cfg)
    b = batcher(cfg, rt)
    rng = random.Random(n)
    # an earlier request leaves its window in the lane's slot
    first = b.submit(prompt_of(30, rng), 2)
    b.run_until_done()
    assert b.requests[first].error is None
    x = b.submit(prompt_of(n, rng), 1, export=True)
    while x not in b.transfers():
        checked_step(b)
    exp = b.take_export(x)
    raw = rt.read_local(0)
    assert torch.equal(exp.local_host, raw)
    payload = pd.make_payload("r", exp.prompt, exp.first_token, exp.host, rt.fingerprint,
                              local_host=exp.local_host)
    kept = set(range(min(n, w)))
    for i in range(w):
        got = payload.local_kv[:, :, :, i]
        if i in kept:
            assert torch.equal(got, raw[:, :, :, i]) and got.abs().sum() > 0, i
        else:
            assert not got.any(), i
    if n < w:  # the stale window really was there: the earlier prompt had 30 > W tokens
        assert raw[:, :, :, n:].any()


def test_plain_payload_checksum_is_unchanged() -> None:
    """A payload without local_kv hashes exactly as before hybrid payloads existed: tag v1,
    canonical header without local_shape, NUL, KV bytes."""
    cfg = config(1, None)
    rt = runtime(cfg)
    host = rt.new_host_buffer()
    host.normal_(generator=torch.Generator().manual_seed(1))
    p = pd.make_payload("r", [1, 2, 3], 4, host, rt.fingerprint, KEY)
    header = {"request_id": "r", "prompt": [1, 2, 3], "first_token": 4, "dtype": "float32",
              "fingerprint": rt.fingerprint, "shape": list(p.kv.shape)}
    msg = (b"atom-core/pd-kv/v1\n"
           + json.dumps(header, sort_keys=True, separators=(",", ":")).encode() + b"\0"
           + p.kv.contiguous().numpy().tobytes())
    assert p.checksum == hashlib.sha256(msg).hexdigest()
    header, tensor = pd.to_wire(p)
    assert "local_shape" not in header and tensor is p.kv


def test_hybrid_payload_round_trips_the_wire_and_is_authenticated() -> None:
    rt, p = exported(16, 40)
    signed = pd.make_payload("r", p.prompt, p.first_token, _host_of(rt, p), p.fingerprint, KEY,
                             local_host=p.local_kv)
    assert torch.equal(signed.local_kv, p.local_kv)
    header, tensor = pd.to_wire(signed)
    assert header["local_shape"] == list(p.local_kv.shape) and tensor.dim() == 1
    q = pd.from_wire(json.loads(json.dumps(header)), tensor.clone())
    assert torch.equal(q.kv, signed.kv) and torch.equal(q.local_kv, signed.local_kv)
    check(q, rt, key=KEY)
    # the same KV without local_kv is another message: different checksum
    assert pd.compute_checksum(attrs.evolve(signed, local_kv=None)) != signed.checksum

    # one local element changed: the checksum fails; recomputing it does not fool the MAC
    bad = q.local_kv.clone()
    bad[0, 0, 0, 39 % 16, 0] += 1
    tampered = attrs.evolve(q, local_kv=bad)
    with pytest.raises(pd.PayloadError) as e:
        check(tampered, rt)
    assert e.value.field == "checksum"
    forged = attrs.evolve(tampered, checksum=pd.compute_checksum(tampered))
    check(forged, rt)  # without a key, a consistent checksum is all there is to check
    with pytest.raises(pd.PayloadError) as e:
        check(forged, rt, key=KEY)
    assert e.value.field == "mac"


def _host_of(rt: TorchReferenceRuntime, p: pd.KVPayload) -> torch.Tensor:
    return pd.write_into(p, rt.new_host_buffer())


def test_wire_refuses_cut_or_malformed_hybrid_messages() -> None:
    rt, p = exported(16, 20)
    header, tensor = pd.to_wire(p)
    with pytest.raises(pd.PayloadError) as e:
        pd.from_wire(header, tensor[:-1])
    assert e.value.field == "shape"
    with pytest.raises(pd.PayloadError) as e:
        pd.from_wire(header, tensor.reshape(1, -1))
    assert e.value.field == "shape"
    for bad in ("abc", [2, -1], [1.5]):
        with pytest.raises(pd.PayloadError) as e:
            pd.from_wire(header | {"local_shape": bad}, tensor)
        assert e.value.field == "header"
    # a receiver that drops local_shape sees a flat tensor where KV was announced
    with pytest.raises(pd.PayloadError) as e:
        pd.from_wire({k: v for k, v in header.items() if k != "local_shape"}, tensor)
    assert e.value.field == "shape"


def test_local_kv_is_required_exact_and_refused_by_plain_models() -> None:
    rt, p = exported(16, 40)
    host = _host_of(rt, p)
    # no window: an old (or buggy) prefill worker of the same model
    stripped = pd.make_payload("r", p.prompt, p.first_token, host, p.fingerprint)
    with pytest.raises(pd.PayloadError, match="carries no sliding-window state") as e:
        check(stripped, rt)
    assert e.value.field == "local_kv"
    # a window of another shape (window 8), or dtype
    for ring in (p.local_kv[:, :, :, :8], p.local_kv.double()):
        other = pd.KVPayload(request_id="r", prompt=p.prompt, first_token=p.first_token,
                             kv=p.kv, dtype=p.dtype, fingerprint=p.fingerprint, checksum="",
                             local_kv=ring.contiguous())
        other = attrs.evolve(other, checksum=pd.compute_checksum(other))
        with pytest.raises(pd.PayloadError) as e:
            check(other, rt)
        assert e.value.field == "local_kv", str(e.value)
    # a plain decode side: a payload of the plain model with a ring attached is refused
    plain = runtime(config(1, None))
    plain_host = plain.new_host_buffer()
    with_ring = pd.make_payload("r", [1, 2, 3], 4, plain_host, plain.fingerprint,
                                local_host=rt.new_local_host_buffer())
    with pytest.raises(pd.PayloadError, match="no sliding-window layers") as e:
        check(with_ring, plain, hybrid=False)
    assert e.value.field == "local_kv"
    check(pd.make_payload("r", [1, 2, 3], 4, plain_host, plain.fingerprint), plain,
          hybrid=False)
    # plain KV into the hybrid side, and hybrid KV into the plain side: another model
    with pytest.raises(pd.PayloadError) as e:
        check(pd.make_payload("r", [1, 2, 3], 4, plain_host, plain.fingerprint), rt)
    assert e.value.field == "fingerprint"
    with pytest.raises(pd.PayloadError) as e:
        check(p, plain, hybrid=False)
    assert e.value.field == "fingerprint"


# --------------------------------------------------------------------------- PD by direct calls
@attrs.define
class Ready:
    prompt: list[int]
    first_token: int
    host: torch.Tensor
    local: torch.Tensor | None


class Link:
    """A prefill batcher P feeding a decode batcher D by direct calls, the hybrid way: every
    payload goes through make_payload(local_host=...), the wire (to_wire/from_wire), validate
    with D's local layout, write_into and import_kv(local_kv=...). `tamper[did]` may replace a
    payload after the wire (a bad sender); a payload validate refuses ends D's transfer, as the
    decode worker does. D requests in `hold` wait in `ready` until `deliver`; P exports in
    `p_hold` are not taken until `take`."""

    def __init__(self, p: AtomBatcher, d: AtomBatcher, hold: Iterable[int] = (),
                 tamper: dict[int, Callable[[pd.KVPayload], pd.KVPayload]] | None = None,
                 p_hold: bool = False) -> None:
        self.p, self.d = p, d
        self.hold = set(hold)
        self.tamper = tamper or {}
        self.p_hold = p_hold
        self.wire: dict[int, int] = {}  # P request -> D request
        self.ready: dict[int, Ready] = {}
        self.waiting_exports: list[int] = []  # P requests whose export is not taken yet
        self.refused: dict[int, str] = {}  # D request -> PayloadError field
        self.d_rt: TorchReferenceRuntime = d.runtime

    def step(self) -> None:
        for e in checked_step(self.d):
            if e.kind == "import":
                pid = self.p.submit(self.d.requests[e.request_id].prompt, 1, export=True)
                self.wire[pid] = e.request_id
        for e in checked_step(self.p):
            if e.kind == "export":
                if self.p_hold:
                    self.waiting_exports.append(e.request_id)
                else:
                    self.take(e.request_id)

    def take(self, pid: int) -> None:
        did = self.wire[pid]
        exp = self.p.take_export(pid)
        payload = pd.make_payload(str(did), exp.prompt, exp.first_token, exp.host,
                                  pd.model_fingerprint(self.p.runtime),
                                  local_host=exp.local_host)
        assert self.p.export_done(pid) == [Event("finished", pid)]
        self.p.check_invariants()
        header, tensor = pd.to_wire(payload)
        payload = pd.from_wire(header, tensor.clone())
        if did in self.tamper:
            payload = self.tamper[did](payload)
        rt = self.d_rt
        local_layout = (tuple(rt.new_local_host_buffer().shape)
                        if self.d.config.sliding_window is not None else None)
        try:
            pd.validate(payload, request_id=str(did), prompt=self.d.requests[did].prompt,
                        fingerprint=pd.model_fingerprint(rt),
                        layout=pd.layout_of(rt.new_host_buffer()),
                        dtype=pd.dtype_name(rt.dtype), vocab_size=rt.vocab_size,
                        local_layout=local_layout)
        except pd.PayloadError as exc:
            self.refused[did] = exc.field
            why = f"KV payload rejected ({exc.field}): {exc}"  # as the decode worker says
            assert [e.kind for e in self.d.transfer_ended(did, why)] == ["error"]
            self.d.check_invariants()
            return
        ready = Ready(list(payload.prompt), payload.first_token,
                      pd.write_into(payload, rt.new_host_buffer()), payload.local_kv)
        if did in self.hold:
            self.ready[did] = ready
        else:
            self._import(did, ready)

    def _import(self, did: int, r: Ready) -> None:
        self.d.import_kv(did, r.prompt, r.first_token, r.host, local_kv=r.local)
        self.d.check_invariants()

    def deliver(self, did: int) -> None:
        self.hold.discard(did)
        self._import(did, self.ready.pop(did))

    def run(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not (self.d.busy() or self.p.busy()):
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def step_until(self, cond: Callable[[], bool], max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if cond():
                return
            self.step()
        raise AssertionError("condition not reached")


def pd_workload(window: int, seed: int, n: int = 8) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lengths = [1, window - 1, window + 1, 64, 200] + [rng.randint(1, 200) for _ in range(n - 5)]
    rng.shuffle(lengths)
    return [(prompt_of(k, rng), rng.randint(1, 16)) for k in lengths]


@pytest.mark.parametrize("window", [16, 64, 100], ids=["W<C", "W=C", "W>C"])
@pytest.mark.parametrize("lanes,scratch", [(1, "dynamic"), (2, "reserved"), (3, "dynamic")])
def test_pd_round_trip_token_exact(lanes: int, scratch: str, window: int) -> None:
    p = batcher(config(2, window))
    d = batcher(config(lanes, window, scratch))
    link = Link(p, d)
    work = pd_workload(window, seed=window)
    rids = [d.submit(prompt, n, remote=True) for prompt, n in work]
    link.run()
    assert_exact(d, rids)
    assert d.stats.prefill_tokens == 0 and link.refused == {}
    assert d.stats.imported_tokens == sum(len(prompt) for prompt, _ in work)
    assert d.runtime.calls["update_local"] == len(work) == p.runtime.calls["fetch_local"]
    assert_idle(d)
    assert_idle(p)


def test_pd_overlap_importing_lane_slot_is_never_padded() -> None:
    """While one import is held the other lanes keep decoding, their padding rows aimed at the
    idle lane's local slot: the held lane's slot is untouched (the kernel's window would shift
    under any write), the delivered window fills it, and every request equals the oracle."""
    w = 16
    p = batcher(config(2, w))
    d = batcher(config(4, w, extra=1))  # a free block for the padding rows of the held lane
    rng = random.Random(7)
    held_prompt = prompt_of(45, rng)  # > W: the window matters
    held = d.submit(held_prompt, 10, remote=True)
    others = [d.submit(prompt_of(k, rng), 12, remote=True) for k in (30, 70)]
    link = Link(p, d, hold=[held])
    link.step_until(lambda: held in link.ready and all(
        d.state.phase.get(r) == core.PHASE_DECODE for r in others))
    lane = d.state.req_lane.get(held)
    idle = [ln for ln in range(4) if not d.state.busy[ln]]
    assert d.state.lane_plen[lane] == len(held_prompt) and len(idle) == 1
    # padding rows write the same KV every step (token 0 at position 0), so blank the idle
    # slot to see the next ones land
    d.runtime.update_local_cache(d.runtime.new_local_host_buffer(), idle[0])
    before = [d.runtime.read_local(ln) for ln in range(4)]
    steps = d.stats.decode_steps
    for _ in range(5):
        link.step()
    assert d.stats.decode_steps == steps + 5  # the others decoded while the import was held
    after = [d.runtime.read_local(ln) for ln in range(4)]
    assert torch.equal(before[lane], after[lane])
    assert not torch.equal(before[idle[0]], after[idle[0]])  # the padding rows went there
    link.deliver(held)
    link.run()
    assert_exact(d, [held, *others])
    assert_idle(d)


def test_pd_decode_waits_while_every_lane_is_busy_and_one_imports() -> None:
    """The cost of never padding a busy lane's slot: with every lane busy and one importing,
    no local slot may take the padding row, so decode waits for the transfer (then resumes,
    exactly). One lane more (an idle one) and it never waits: the test above."""
    w = 16
    p = batcher(config(2, w))
    d = batcher(config(3, w, extra=1))
    rng = random.Random(7)
    held = d.submit(prompt_of(45, rng), 10, remote=True)
    others = [d.submit(prompt_of(k, rng), 12, remote=True) for k in (30, 70)]
    link = Link(p, d, hold=[held])
    link.step_until(lambda: held in link.ready and all(
        d.state.phase.get(r) == core.PHASE_DECODE for r in others))
    assert all(d.state.busy)
    steps = d.stats.decode_steps
    for _ in range(3):
        link.step()
    assert d.stats.decode_steps == steps
    lane = d.state.req_lane.get(held)
    assert core.decode_guard(d.state, d.policy.pad(d.state), lane, (0,) * 3) == "local_pad_ok"
    link.deliver(held)
    link.run()
    assert_exact(d, [held, *others])
    assert_idle(d)


@pytest.mark.parametrize("lanes", [2, 3])
def test_the_local_slot_rule_is_tight(lanes: int) -> None:
    """The spec's rule on the generated core: with every lane busy and one prefilling, decode
    is refused by `local_pad_ok` for every choice of local slot (so B lanes run without decode
    waiting only while at most B - 1 are busy: B + 1 local slots for B requests); one lane more
    and the same run decodes, padding in the idle lane's slot. Not stuck either way: the
    prefilling lane can go on."""
    from atom_core.seq import seq
    c = 2
    for b in (lanes, lanes + 1):
        s = core.init(core.Consts(B=b, K=b + 1, C=c, S=8, PREFIX=False, RESERVED=False,
                                  SCRATCH=0, HYBRID=True), ghost=True)
        run: list[tuple[str, dict]] = []
        for r in range(lanes):
            run += [("submit", {"r": r, "p": seq([1 + r] * (c + 1))}),
                    ("admit_miss", {"l": r, "r": r, "dst": r}), ("prefill", {"l": r, "tok": 5})]
            if r < lanes - 1:  # all but the last finish their prompt and decode
                run.append(("prefill", {"l": r, "tok": 5}))
        for name, args in run:
            step = core.ACTIONS[name][0](s, **args)
            assert step.rejected is None, (name, step.rejected)
            s = step.state
        assert core.check_invariants(s) == []
        tok = (5,) * b
        why = {x: core.decode_guard(s, lanes, x, tok) for x in range(b)}
        if b == lanes:
            assert set(why.values()) == {"local_pad_ok"}, why
            assert core.prefill_guard(s, lanes - 1, 5) is None
            assert core.progress_violations(s) == []
        else:
            assert why[b - 1] is None, why
            (dec,) = core.decode(s, lanes, b - 1, tok).effects
            assert dec.local == tuple(range(lanes - 1)) + (b - 1, b - 1)


def test_a_spare_local_slot_keeps_decode_from_waiting() -> None:
    """The price of never waiting: `Policy(spare_local_slot=True)` leaves one lane idle, so the
    3-lane decode side runs 2 requests at a time, and decodes while an import is held."""
    w = 16
    p = batcher(config(2, w))
    cfg = config(3, w, extra=1)
    d = AtomBatcher(cfg, runtime(cfg), ghost=True, policy=Policy(spare_local_slot=True))
    rng = random.Random(7)
    held = d.submit(prompt_of(45, rng), 10, remote=True)
    others = [d.submit(prompt_of(k, rng), 12, remote=True) for k in (30, 70)]
    link = Link(p, d, hold=[held])
    link.step_until(lambda: held in link.ready
                    and d.state.phase.get(others[0]) == core.PHASE_DECODE)
    assert sum(d.state.busy) == 2 and d.state.phase.get(others[1]) == core.PHASE_WAITING
    steps = d.stats.decode_steps
    for _ in range(3):
        link.step()
        assert sum(d.state.busy) <= 2
    assert d.stats.decode_steps == steps + 3
    link.deliver(held)
    link.run()
    assert_exact(d, [held, *others])
    assert_idle(d)


def test_pd_export_waiting_on_the_prefill_side_stays_exact() -> None:
    """An export not taken at once: while the prefill side decodes another request, its
    padding rows go to the idle lane's slot, so the exporting lane's window is untouched and
    ships the same as an export taken at once; the import is exact."""
    w = 16
    p = batcher(config(3, w, extra=1))
    d = batcher(config(1, w))
    rng = random.Random(11)
    prompt = prompt_of(37, rng)
    local = p.submit(prompt_of(20, rng), 15)  # keeps P decoding
    link = Link(p, d, p_hold=True)
    rid = d.submit(prompt, 9, remote=True)
    link.step_until(lambda: bool(link.waiting_exports))
    (pid,) = link.waiting_exports
    lane = p.state.req_lane.get(pid)
    before = p.runtime.read_local(lane)
    steps = p.stats.decode_steps
    for _ in range(4):
        checked_step(p)
    assert p.stats.decode_steps == steps + 4
    assert torch.equal(before, p.runtime.read_local(lane))
    exp = p.take_export(pid)
    late = pd.make_payload("x", exp.prompt, exp.first_token, exp.host, "f",
                           local_host=exp.local_host)
    link.take(pid)
    link.waiting_exports.clear()
    link.p_hold = False
    link.run()
    assert_exact(d, [rid])
    assert_exact(p, [local])
    # the same prompt exported at once by a fresh prefill side ships the same window
    fresh = batcher(config(1, w))
    x = fresh.submit(prompt, 1, export=True)
    while x not in fresh.transfers():
        checked_step(fresh)
    e2 = fresh.take_export(x)
    now = pd.make_payload("x", e2.prompt, e2.first_token, e2.host, "f", local_host=e2.local_host)
    assert torch.equal(now.local_kv, late.local_kv) and torch.equal(now.kv, late.kv)
    assert now.checksum == late.checksum


def _strip(payload: pd.KVPayload) -> pd.KVPayload:
    """The payload a sender that ships no ring would send (consistently checksummed)."""
    out = attrs.evolve(payload, local_kv=None)
    return attrs.evolve(out, checksum=pd.compute_checksum(out))


def _narrow(payload: pd.KVPayload) -> pd.KVPayload:
    assert payload.local_kv is not None
    out = attrs.evolve(payload, local_kv=payload.local_kv[:, :, :, :-1].contiguous())
    return attrs.evolve(out, checksum=pd.compute_checksum(out))


@pytest.mark.parametrize("tamper", [_strip, _narrow], ids=["no-local_kv", "wrong-shape"])
def test_pd_bad_ring_fails_only_its_request(tamper: Callable[[pd.KVPayload], pd.KVPayload]
                                            ) -> None:
    w = 16
    p = batcher(config(2, w))
    d = batcher(config(2, w))
    rng = random.Random(3)
    work = [(prompt_of(k, rng), 6) for k in (40, 20, 90, 5)]
    rids = [d.submit(prompt, n, remote=True) for prompt, n in work]
    bad = rids[1]
    link = Link(p, d, tamper={bad: tamper})
    link.run()
    assert link.refused == {bad: "local_kv"}
    r = d.requests[bad]
    assert r.ended and r.tokens == [] and "local_kv" in (r.error or "")
    assert_exact(d, [x for x in rids if x != bad])
    assert d.stats.transfer_failures == 1
    assert_idle(d)


def _importing(d: AtomBatcher, n: int) -> list[int]:
    """Step d until n remote requests hold a lane and wait for their KV."""
    while sum(d.state.phase.get(r) == core.PHASE_IMPORTING for r in d.requests) < n:
        checked_step(d)
    return [r for r in d.requests if d.state.phase.get(r) == core.PHASE_IMPORTING]


def _export_of(prompt: list[int], window: int | None) -> tuple[pd.KVPayload, torch.Tensor]:
    """A signed-less payload of `prompt` from a one-lane prefill batcher, and its write_into
    host buffer."""
    p = batcher(config(1, window))
    x = p.submit(prompt, 1, export=True)
    while x not in p.transfers():
        checked_step(p)
    exp = p.take_export(x)
    payload = pd.make_payload("x", exp.prompt, exp.first_token, exp.host,
                              pd.model_fingerprint(p.runtime), local_host=exp.local_host)
    p.export_done(x)
    return payload, pd.write_into(payload, p.runtime.new_host_buffer())


@pytest.mark.parametrize("how", ["missing", "wrong-shape", "not-a-tensor"])
def test_import_kv_without_a_usable_ring_fails_only_that_request(how: str) -> None:
    """The batcher API itself: a hybrid import_kv without local_kv fails that request before
    anything is written (like a partial import); so does one whose ring is not exactly the
    local slot's layout (import_kv names the field before the runtime sees it)."""
    w = 16
    d = batcher(config(2, w))
    rng = random.Random(5)
    prompts = [prompt_of(40, rng), prompt_of(25, rng)]
    rids = [d.submit(pr, 7, remote=True) for pr in prompts]
    assert sorted(_importing(d, 2)) == rids
    payloads = [_export_of(pr, w) for pr in prompts]
    (bad_p, bad_host), (good_p, good_host) = payloads
    local: Any = {"missing": None, "wrong-shape": bad_p.local_kv[:, :, :, :8].contiguous(),
                  "not-a-tensor": [0.0]}[how]
    updates = d.runtime.calls["update"]
    events = d.import_kv(rids[0], bad_p.prompt, bad_p.first_token, bad_host, local_kv=local)
    assert [e.kind for e in events] == ["error"]
    err = events[0].error or ""
    assert "local_kv" in err and d.runtime.calls["update"] == updates  # nothing written
    if how != "missing":
        assert err.startswith("import rejected (local_kv): local_kv ")
    d.check_invariants()
    assert d.import_kv(rids[1], good_p.prompt, good_p.first_token, good_host,
                       local_kv=good_p.local_kv)[0] == Event("token", rids[1],
                                                             token=good_p.first_token)
    while d.busy():
        checked_step(d)
    assert_exact(d, [rids[1]])
    assert d.requests[rids[0]].error == err
    assert_idle(d)


def test_plain_decode_batcher_refuses_a_ring() -> None:
    d = batcher(config(1, None))
    prompt = prompt_of(10, random.Random(1))
    (rid,) = [d.submit(prompt, 3, remote=True)]
    _importing(d, 1)
    payload, host = _export_of(prompt, None)
    events = d.import_kv(rid, payload.prompt, payload.first_token, host,
                         local_kv=torch.zeros(2, 2, 2, 16, 16))
    assert [e.kind for e in events] == ["error"]
    assert "local_kv" in (events[0].error or "") and "no sliding-window layers" in (
        events[0].error or "")
    assert_idle(d)


def test_export_record_carries_the_ring_only_for_hybrid_models() -> None:
    """take_export's record has the lane's local ring for a hybrid model, None for a plain one
    (a record, not a tuple: a caller cannot drop the ring by unpacking)."""
    for window in (None, 16):
        p = batcher(config(1, window))
        x = p.submit([1, 2, 3], 1, export=True)
        while x not in p.transfers():
            checked_step(p)
        exp = p.take_export(x)
        with pytest.raises(TypeError):
            prompt, tok, host = exp
        if window is None:
            assert exp.local_host is None
        else:
            assert torch.equal(exp.local_host, p.runtime.read_local(0))


# --------------------------------------------------------------------------- workers
def test_workers_in_process_token_exact() -> None:
    w = 16
    dcfg, pcfg = config(3, w, extra=1), config(2, w, seq_len=2 * S)  # sizes may differ
    td, tp = InProcessTransport.pair()
    pw = PrefillWorker(pcfg, runtime(pcfg), tp, key=KEY)
    dw = DecodeWorker(dcfg, runtime(dcfg), td, key=KEY, prefetch=2)
    work = pd_workload(w, seed=21, n=9)
    wids = [dw.submit(prompt, n) for prompt, n in work]
    Rig(dw, pw, td, tp).pump()
    results = dw.results()
    for wid, (prompt, n) in zip(wids, work, strict=True):
        assert results[wid].error is None, results[wid].error
        assert results[wid].tokens == oracle_for(dw.runtime).generate(prompt, n), wid
    s = dw.summary()
    assert s["completed"] == len(work) and s["payload_errors"] == {}
    assert s["imported_tokens"] == sum(len(prompt) for prompt, _ in work)
    assert s["local_prefill_tokens"] == 0 and pw.stats.exports == len(work)
    assert dw.runtime.calls["update_local"] == len(work)
    dw.close()


# --------------------------------------------------------------------------- why the ring travels
def _prefill(rt: TorchReferenceRuntime, prompt: list[int], lane: int) -> int:
    """Prefill `prompt` into block `lane` and local slot `lane`; the greedy first token."""
    logits = None
    for s in range(0, len(prompt), C):
        chunk = prompt[s:s + C]
        ids = torch.tensor([chunk + [0] * (C - len(chunk))])
        pos = torch.arange(s, s + C, dtype=torch.int32)[None]
        logits = rt.prefill(ids, pos, torch.tensor([lane], dtype=torch.int16),
                            torch.tensor([lane], dtype=torch.int16),
                            torch.tensor(len(chunk) - 1, dtype=torch.int16))
    assert logits is not None
    return int(torch.argmax(logits[0, -1]))


def _decode(rt: TorchReferenceRuntime, prompt: list[int], first: int, steps: int) -> list[int]:
    """Greedy decode of lane 0 (block 0, slot 0) from the prompt's KV; row 1 pads in block 1
    at position 0 of slot 1."""
    out, tok = [first], first
    for i in range(steps):
        ids = torch.tensor([[tok], [0]])
        pos = torch.tensor([[len(prompt) + i], [0]], dtype=torch.int32)
        rows = torch.tensor([[0], [1]], dtype=torch.int16)
        logits = rt.decode(ids, pos, rows, rows)
        tok = int(torch.argmax(logits[0, -1]))
        out.append(tok)
    return out


def test_importing_only_the_global_kv_is_not_enough() -> None:
    """A prompt longer than the window, prefilled on one runtime; its global KV moved into a
    fresh runtime's block 0. Decoding there equals the oracle only when the local ring moves
    too; with the slot left zero, or holding another prompt's ring, the outputs differ."""
    w = 16
    cfg = config(2, w)
    rng = random.Random(2)
    prompt, other = prompt_of(50, rng), prompt_of(50, rng)
    steps = 12
    want = oracle_for(runtime(cfg)).generate(prompt, steps + 1)

    src = runtime(cfg)
    first = _prefill(src, prompt, lane=0)
    host, ring = src.new_host_buffer(), src.new_local_host_buffer()
    src.fetch_kv_cache(host, 0)
    src.fetch_local_cache(ring, 0)

    def moved(local: str) -> list[int]:
        dst = runtime(cfg)
        if local == "stale":
            _prefill(dst, other, lane=0)  # an earlier request's ring stays in slot 0
        dst.update_kv_cache(host, 0)
        if local == "moved":
            dst.update_local_cache(ring, 0)
        return _decode(dst, prompt, first, steps)

    assert moved("moved") == want  # the control: global KV and ring together are exact
    for local in ("zero", "stale"):
        got = moved(local)
        assert got != want, local
        assert got[0] == want[0]  # the first token came with the payload
