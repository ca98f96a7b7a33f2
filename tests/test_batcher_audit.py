"""An audit of AtomBatcher's public API against bug classes public serving engines have had in
their schedulers' request handling. Each test here failed before its fix:

- logits a runtime got wrong: NaN or inf logits were served as tokens (argmax picks a NaN's
  index); a [1, V] prefill output read as a scalar (token 0); logits wider than the vocabulary
  emitted an id the next decode could not embed, failing every lane; a decode output with too
  few rows raised out of `step()` (which stops a serving engine). Now the call's requests fail
  with an error naming the shape or the non-finite row, the row's alone when only it is bad;
- `complete()` given a prefill's whole-chunk logits [1, C, V] (as its docstring allows) read
  position C - 1, a padding position of a short last chunk, instead of the last real token;
- `abort()` between `plan()` and `complete()` was accepted, so complete() refused the step and
  the next step ran the planned call a second time: on a hybrid model that appends to every
  decoding row's sliding window twice, changing another request's tokens;
- an engine's token for a prefill chunk that emits nothing (never read) failed its request;
- submit refused numpy integers for max_new_tokens and eos_token_id (and abort for the id)
  while taking them as prompt ids, and took a non-callable sampler, failing only at its first
  token.

Every test uses the real batcher and the torch reference runtime (a subclass that corrupts its
outputs on purpose where a fault is the point), and compares tokens with the cache-free oracle.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config
from atom_core.demo import oracle_for
from atom_core.runtime import TorchReferenceRuntime

C, V = 64, 128
_rng = random.Random(11)
PA = [_rng.randrange(V) for _ in range(40)]
PB = [_rng.randrange(V) for _ in range(37)]
LONG = [_rng.randrange(V) for _ in range(150)]  # three chunks


def config(**kw: Any) -> Config:
    return Config(lanes=2, max_seq_len=256, prefill_chunk=C, **{"kv_blocks": 3, **kw})


def oracle(b: AtomBatcher, rid: int) -> list[int]:
    r = b.requests[rid]
    return oracle_for(b.runtime).generate(r.prompt, r.max_new_tokens, r.eos_token_id)


def at_rest(b: AtomBatcher) -> None:
    """Nothing runs and no block leaked: every block free, cached or the scratch block."""
    b.check_invariants()
    s = b.state
    assert not b.busy() and not any(s.busy) and not b.transfers()
    assert {core.OWNER_NAMES[o] for o in s.owner} <= {"FREE", "CACHE", "SCRATCH"}


def drive(b: AtomBatcher, max_steps: int = 2000) -> list[Event]:
    """step() to the end, the invariants after every step; step() must never raise."""
    log: list[Event] = []
    for _ in range(max_steps):
        if not b.busy():
            return log
        log += b.step()
        b.check_invariants()
    raise AssertionError(f"not done after {max_steps} steps")


class Corrupting(TorchReferenceRuntime):
    """The reference runtime whose `call`-th prefill or decode call (from 0) returns logits
    changed by `how` (a device or binding fault); every other call is exact."""

    def __init__(self, cfg: Config, call: str, at: int, how: str) -> None:
        base = TorchReferenceRuntime.tiny(cfg)
        super().__init__(base.spec, seed=base.seed)
        self.target, self.at, self.how, self.n = call, at, how, 0

    def _maybe(self, call: str, out: torch.Tensor) -> torch.Tensor:
        if call != self.target:
            return out
        self.n += 1
        if self.n - 1 != self.at:
            return out
        out = out.clone()
        if self.how == "nan":  # one NaN in row 0 (argmax returns the NaN's index)
            out[0, -1, 5] = float("nan")
        elif self.how == "inf":
            out[0, -1, 7] = float("inf")
        elif self.how == "-inf":  # nothing finite in row 0
            out[0, -1, :] = float("-inf")
        elif self.how == "2d":  # [rows, V]: a binding that squeezed the position axis
            return out[:, -1, :]
        elif self.how == "wide":  # a padded LM head: ids past the vocabulary, the best one
            wide = torch.full((out.shape[0], 1, V + 64), -1e4, dtype=out.dtype)
            wide[..., :V] = out
            wide[..., V + 3] = 1e4
            return wide
        elif self.how == "rows":  # the rows of a smaller decode graph
            return out[:1]
        return out

    def prefill(self, *args: Any) -> torch.Tensor:
        return self._maybe("prefill", super().prefill(*args))

    def decode(self, *args: Any) -> torch.Tensor:
        return self._maybe("decode", super().decode(*args))


# --------------------------------------------------------------------------- logits
@pytest.mark.parametrize("how", ["nan", "inf", "-inf"])
def test_non_finite_decode_logits_fail_only_their_row(how: str) -> None:
    """Row 0 of the second decode call is not finite: its request fails naming that, the other
    row's request is served exactly, no block leaks, and the batcher keeps serving (the failed
    request's partial KV is never a prefix hit: the same prompt again is computed, exactly)."""
    cfg = config(kv_blocks=4, prefix_cache=True)
    b = AtomBatcher(cfg, Corrupting(cfg, "decode", 1, how), ghost=True)
    bad, good = b.submit(PA, 6), b.submit(PB, 6)
    drive(b)
    assert b.requests[bad].error is not None and "not finite" in b.requests[bad].error
    assert b.requests[bad].tokens == oracle(b, bad)[:2]  # the tokens before the bad row
    assert b.requests[good].error is None and b.requests[good].tokens == oracle(b, good)
    at_rest(b)
    again = b.submit(PA, 6)
    drive(b)
    assert b.requests[again].error is None and b.requests[again].tokens == oracle(b, again)
    at_rest(b)


@pytest.mark.parametrize("how", ["nan", "inf", "-inf"])
def test_non_finite_prefill_logits_fail_only_that_request(how: str) -> None:
    cfg = config()
    b = AtomBatcher(cfg, Corrupting(cfg, "prefill", 1, how), ghost=True)
    good, bad = b.submit(PA, 5), b.submit(PB, 5)
    drive(b)
    assert b.requests[bad].tokens == [] and "not finite" in (b.requests[bad].error or "")
    assert b.requests[good].error is None and b.requests[good].tokens == oracle(b, good)
    assert b.stats.runtime_errors == 1 and b.stats.generated_tokens == 5
    at_rest(b)


@pytest.mark.parametrize("call, how", [
    ("decode", "rows"),     # raised IndexError out of step()
    ("decode", "2d"),
    ("decode", "wide"),     # emitted id 131, then the next decode failed on it
    ("prefill", "2d"),      # read a scalar: token 0, served as the model's
    ("prefill", "wide"),    # emitted id 131: the next decode failed for every lane
])
def test_logits_of_the_wrong_shape_fail_the_call_not_the_batcher(call: str, how: str) -> None:
    cfg = config()
    b = AtomBatcher(cfg, Corrupting(cfg, call, 1, how), ghost=True)
    first, second = b.submit(PA, 5), b.submit(PB, 5)
    log = drive(b)
    assert all(e.token is None or 0 <= e.token < V for e in log)  # no id past the vocabulary
    hit = [second] if call == "prefill" else [first, second]
    for rid in hit:
        assert "logits have shape" in (b.requests[rid].error or ""), b.requests[rid].error
    if call == "prefill":  # the first request was decoding: untouched
        assert b.requests[first].error is None and b.requests[first].tokens == oracle(b, first)
    at_rest(b)
    after = b.submit(PB, 5)  # the batcher keeps serving
    drive(b)
    assert b.requests[after].tokens == oracle(b, after)
    at_rest(b)


def test_whole_chunk_prefill_logits_read_the_last_real_token() -> None:
    """An engine passing a prefill's logits for every position of the chunk [1, C, V] (what
    the reference model gives at each position, padding included): the token is the one after
    the prompt's last token, as with [1, 1, V], not the one after the chunk's padding."""
    cfg = config()
    a, b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True), \
        AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)
    for x in (a, b):
        x.submit(PA, 4)
        x.submit(LONG, 4)
    rt = a.runtime
    while a.busy() or b.busy():
        plan = a.plan()
        if plan.call == "prefill":
            rt.prefill(*plan.args())  # the chunk's KV; its logits, every position's, follow
            ids = plan.ids[0].tolist()
            start = int(plan.positions[0, 0])
            req = a.requests[a.state.lane_req[plan.lanes[0]]]
            seq = (req.prompt + req.tokens)[:start]
            full = torch.stack([rt.oracle_logits(seq + ids[:i + 1]) for i in range(C)])[None]
            assert not torch.equal(full[0, int(plan.last)], full[0, -1]) or \
                int(plan.last) == C - 1
            got = a.complete(full)
        elif plan.call == "decode":
            got = a.complete(rt.decode(*plan.args()))
        else:
            got = a.complete()
        assert got == b.step()
    for rid in a.requests:
        assert a.requests[rid].tokens == oracle(a, rid) == b.requests[rid].tokens
    at_rest(a)


def test_engine_tokens_of_a_chunk_that_emits_nothing_are_not_read() -> None:
    """complete(tokens=...) for a prefill chunk before the prompt's last: the token is never
    used, so an engine that does not sample there (passing -1 or None) is served normally."""
    cfg = config()
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)
    rid = b.submit(LONG, 4)
    for dummy in (-1, None):
        plan = b.plan()
        assert plan.call == "prefill" and int(plan.positions[0, 0]) + C < len(LONG)
        b.runtime.prefill(*plan.args())
        assert b.complete(tokens=[dummy]) == []
    drive(b)
    assert b.requests[rid].error is None and b.requests[rid].tokens == oracle(b, rid)
    at_rest(b)


# --------------------------------------------------------------------------- plan / complete
def test_abort_between_plan_and_complete_keeps_hybrid_neighbours_exact() -> None:
    """A hybrid model's decode appends to each row's sliding window. abort() after the planned
    call ran used to make complete() refuse the step and the next step run it again, so the
    other request's window held a position twice and its tokens changed. Now abort() is
    refused with nothing changed, complete() takes the step, and abort() after it works."""
    cfg = Config(lanes=2, kv_blocks=3, max_seq_len=128, prefill_chunk=C, sliding_window=16)
    rt = TorchReferenceRuntime.tiny(cfg, sliding_window=16, layers=3, global_every=3)
    b = AtomBatcher(cfg, rt, ghost=True)
    gone, kept = b.submit(PA, 10), b.submit(PB, 10)
    for _ in range(3):
        b.step()
    plan = b.plan()
    assert plan.call == "decode" and plan.lanes == (0, 1)
    out = rt.decode(*plan.args())  # the device ran the call
    before = b.state
    for call in (lambda: b.abort(gone), lambda: b.transfer_ended(gone, "x"),
                 lambda: b.export_done(gone)):
        with pytest.raises(RuntimeError, match="while a plan is pending"):
            call()
        assert b.state == before and not b.requests[gone].ended
    events = b.complete(out)
    assert {e.request_id for e in events if e.kind == "token"} == {gone, kept}
    assert b.abort(gone) and b.requests[gone].error == "aborted"
    drive(b)
    assert b.requests[kept].error is None and b.requests[kept].tokens == oracle(b, kept)
    at_rest(b)


def test_forget_between_plan_and_complete_keeps_the_plan() -> None:
    """forget() drops an ended request, which holds nothing a plan chose: like submit(), it
    leaves the pending plan valid."""
    cfg = config()
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), keep_ended=None, ghost=True)
    done, running = b.submit(PA, 1), b.submit(PB, 5)
    while not b.requests[done].ended:
        b.step()
    plan = b.plan()
    assert plan.call is not None and b.forget(done) and done not in b.requests
    b.complete(getattr(b.runtime, plan.call)(*plan.args()))
    drive(b)
    assert b.requests[running].tokens == oracle(b, running)
    at_rest(b)


# --------------------------------------------------------------------------- submit / abort
def test_numpy_integers_are_integers_everywhere_and_a_sampler_must_be_callable() -> None:
    cfg = config()
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)
    eos = oracle_for(b.runtime).generate(PA, 6)[2]
    rid = b.submit(np.array(PA, dtype=np.int32), np.int64(6), np.int64(eos))
    req = b.requests[rid]
    assert type(req.max_new_tokens) is int and type(req.eos_token_id) is int
    other = b.submit(PB, torch.tensor(4), torch.tensor(eos))
    for bad in ("greedy", 3):
        with pytest.raises(ValueError, match="sampler must be a callable"):
            b.submit(PB, 4, sampler=bad)  # type: ignore[arg-type]
    assert sorted(b.requests) == [rid, other]  # the refused ones queued nothing
    b.step()
    assert b.abort(np.int64(other)) and b.requests[other].error == "aborted"
    drive(b)
    assert req.error is None and req.tokens == oracle(b, rid) and req.tokens[-1] == eos
    at_rest(b)


def test_an_aborted_prefill_is_never_a_prefix_hit() -> None:
    """A request aborted after its first chunk (its KV partly computed) leaves nothing a later
    request with the same prompt could hit: that one computes its prompt, exactly, and the
    request beside it is untouched."""
    cfg = config(kv_blocks=9, block_size=64, prefix_cache=True)
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), ghost=True)
    beside = b.submit(PB, 8)
    gone = b.submit(LONG, 8)
    while b.stats.prefill_tokens < len(PB) + C:  # beside's prompt, then gone's first chunk
        b.step()
    assert b.phase(gone) == core.PHASE_PREFILL
    assert b.abort(gone) and not b.abort(gone)  # twice: the second changes nothing
    b.check_invariants()
    hits = b.stats.prefix_hit_tokens
    again = b.submit(LONG, 8)
    drive(b)
    assert b.stats.prefix_hit_tokens == hits  # nothing of the aborted prefill was cached
    assert b.requests[again].tokens == oracle(b, again)
    assert b.requests[beside].tokens == oracle(b, beside)
    at_rest(b)


class Interrupted(TorchReferenceRuntime):
    """A decode call interrupted once (Ctrl-C inside the device call)."""

    armed = True

    def decode(self, *args: Any) -> Any:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return super().decode(*args)


def test_an_interrupt_inside_the_call_fails_its_requests_and_leaves_no_plan_pending() -> None:
    cfg = config()
    b = AtomBatcher(cfg, Interrupted.tiny(cfg))
    rid = b.submit(PA, 6)
    with pytest.raises(KeyboardInterrupt):
        drive(b)
    assert b.requests[rid].ended and "KeyboardInterrupt" in (b.requests[rid].error or "")
    other = b.submit(PB, 4)  # the batcher goes on: no plan left pending
    drive(b)
    assert b.requests[other].tokens == oracle(b, other)
    at_rest(b)
