"""The scheduler on its own (`atom_core/scheduler/`): it imports no torch, it calls no
runtime (only the executor, `AtomBatcher`, does), and driven directly, with hypothesis
choosing every outcome of its block work and of its calls (done or failed, tokens, a row's own
failure, PD transfers delivered or failed), the core's invariants and its block tables hold
after every step and every request ends once."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from atom_core._generated import core
from atom_core.batcher import AtomBatcher
from atom_core.config import Config, min_kv_blocks
from atom_core.runtime import TorchReferenceRuntime
from atom_core.scheduler import (
    CopyWork,
    DecodeCall,
    Event,
    MixedCall,
    PrefillCall,
    Scheduler,
    StepOutput,
    StepResult,
)

VOCAB = 12
EOS = 11


def test_imports_no_torch() -> None:
    """With torch refused by an import hook, the scheduler imports and schedules a step."""
    code = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is refused here")
        return None
sys.meta_path.insert(0, Refuse())
from atom_core.config import Config
from atom_core.scheduler import PrefillCall, Scheduler
s = Scheduler(Config(lanes=2, kv_blocks=4, max_seq_len=128, prefill_chunk=64), vocab_size=10)
s.submit([1, 2, 3], 2)
out = s.schedule()
assert isinstance(out.call, PrefillCall), out
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


class Raising:
    """A runtime that has the protocol's sizes (the batcher reads them once, at construction)
    and whose every method raises, counting the calls."""

    vocab_size = VOCAB
    uses_local_block_tables = False

    def __init__(self, cfg: Config) -> None:
        self.calls: list[str] = []
        self.num_blocks, self.block_size = cfg.kv_blocks, cfg.block_size
        self.max_seq_len, self.prefill_chunk = cfg.max_seq_len, cfg.prefill_chunk
        self.batch_size = cfg.lanes
        self.decoder_batch_sizes = (cfg.lanes,)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("sliding_window", "host_kv_transfers"):
            raise AttributeError(name)

        def call(*_args: Any) -> Any:
            self.calls.append(name)
            raise RuntimeError(f"{name} is not for the scheduler to call")
        return call


def test_schedule_calls_no_runtime() -> None:
    """The scheduler's steps run to their end with a runtime that raises on every method:
    only the executor calls it (and then its calls fail the requests they touched)."""
    cfg = Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "reserved", 2) + 1, max_seq_len=256,
                 block_size=128, prefill_chunk=64, prefix_cache=True)
    rt = Raising(cfg)
    b = AtomBatcher(cfg, rt, keep_ended=None)
    shared = [1 + i % 9 for i in range(150)]
    b.submit(shared, 3)
    sched = b.scheduler
    seen: list[Any] = []
    for _ in range(12):  # the scheduler alone, its outcomes made up here: no runtime call
        out = sched.schedule()
        while not out.done:
            seen.extend(out.work)
            seen.append(out.call)
            out = sched.update(_succeed(out, cfg.lanes))
        if len(seen) > 3 and not sched.busy():
            b.submit(shared + [3], 2)  # a prefix hit: block work (a copy)
    assert rt.calls == []
    assert any(isinstance(w, CopyWork) for w in seen)
    assert any(isinstance(c, DecodeCall) for c in seen)
    b.check_invariants()
    # the executor is what calls the runtime: its failures fail the requests, nothing else
    rid = b.submit(shared + [4], 2)
    events = []
    while b.busy():
        events += b.step()
    assert rt.calls and b.requests[rid].error is not None
    assert Event("error", rid, error=b.requests[rid].error) in events
    b.check_invariants()


def _succeed(out: StepOutput, lanes: int) -> StepResult:
    if out.work:
        return StepResult(work=(None,) * len(out.work))
    if isinstance(out.call, PrefillCall):
        return StepResult(tokens=(1,), row_errors=(None,))
    return StepResult(tokens=(2,) * lanes, row_errors=(None,) * lanes)


# --------------------------------------------------------------- drawn outcomes
def _config(name: str, lanes: int, extra: int) -> Config:
    t, prefix, scratch, host, window, preempt = {
        "plain": (1, False, "reserved", 0, None, False),
        "prefix": (1, True, "dynamic", 0, None, False),
        "paged-prefix": (4, True, "reserved", 0, None, False),
        "host": (2, True, "dynamic", 2, None, False),
        "preempt": (4, True, "dynamic", 0, None, True),
        "hybrid-prefix": (2, True, "reserved", 0, 64, False),
    }[name]
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch, t,
                                                       preemption=preempt) + extra,
                  max_seq_len=256, block_size=256 // t, prefill_chunk=64, prefix_cache=prefix,
                  scratch=scratch, host_cache_blocks=host, sliding_window=window,
                  preemption=preempt)


STEMS = ([1] * 130, [2, 3] * 70, [4] * 64)


@st.composite
def prompts(draw: Any) -> list[int]:
    stem = draw(st.sampled_from(STEMS))
    keep = draw(st.sampled_from((1, 64, 65, 128, 129, len(stem))))
    tail = draw(st.lists(st.integers(0, VOCAB - 2), max_size=70) | st.just([]))
    return (stem[:keep] + tail)[:200]


def _outcome(data: Any, out: StepOutput, s: Scheduler) -> StepResult:
    """Hypothesis picks what the outside world did."""
    if out.work:
        return StepResult(work=tuple(
            data.draw(st.sampled_from((None, None, None, "failed")), label=type(w).__name__)
            for w in out.work))
    if data.draw(st.integers(0, 19), label="call fails") == 0:
        return StepResult(error="RuntimeError('drawn')")
    call = out.call
    rows = (1 if isinstance(call, PrefillCall) else s.config.lanes
            if isinstance(call, DecodeCall) else len(call.prefills)
            + (s.config.lanes if call.decode is not None else 0))
    toks = tuple(data.draw(st.integers(0, VOCAB - 1), label="token") for _ in range(rows))
    # (the end token seldom, so requests run long enough to grow and be preempted)
    toks = tuple(t if t != EOS or data.draw(st.booleans()) else 0 for t in toks)
    bad = tuple(None if data.draw(st.integers(0, 30), label="row fails") else "row failed"
                for _ in range(rows))
    return StepResult(tokens=toks, row_errors=bad)


@pytest.mark.parametrize("name", ["plain", "prefix", "paged-prefix", "host", "preempt",
                                  "hybrid-prefix", "mixed-preempt", "mixed-host"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_scheduler_under_drawn_outcomes(name: str, data: Any) -> None:
    """(mixed-*: a runtime that takes a decode and a prompt chunk in one call, `MixedCall`)"""
    mixed = name.startswith("mixed-")
    cfg = _config(name.removeprefix("mixed-"), data.draw(st.integers(1, 3), label="lanes"),
                  data.draw(st.integers(0, 2), label="extra blocks"))
    s = Scheduler(cfg, ghost=True, vocab_size=VOCAB, mixed=mixed,
                  prefill_tokens=data.draw(st.sampled_from((64, 128, 1000)), label="budget"),
                  keep_ended=data.draw(st.sampled_from((None, 0, 2)), label="keep_ended"))
    calls: set[type] = set()
    ended: set[int] = set()
    pending_pd: list[Event] = []  # "import" and "export" events not answered yet
    for _ in range(data.draw(st.integers(1, 80), label="moves")):
        move = data.draw(st.sampled_from(("submit", "submit") + ("step",) * 8
                                         + ("abort", "finish", "pd", "pd")), label="move")
        if move == "submit":
            kind = data.draw(st.sampled_from(("local", "local", "remote", "export")))
            s.submit(data.draw(prompts()), data.draw(st.integers(1, 80)), EOS,
                     remote=kind == "remote", export=kind == "export")
        elif move == "abort" and s.requests:
            if s.abort(data.draw(st.sampled_from(sorted(s.requests)))):
                pass  # (the abort's end is not an event: the caller asked for it)
        elif move == "finish" and s.requests:
            # an engine's own stop (a stop string): a normal end if decoding, else an abort
            _check_events(s.finish(data.draw(st.sampled_from(sorted(s.requests)))), ended,
                          pending_pd)
        elif move == "pd" and pending_pd:
            ev = pending_pd.pop(data.draw(st.integers(0, len(pending_pd) - 1)))
            events: list[Event] = []
            phase = s.phase(ev.request_id)
            if ev.kind == "import" and phase == core.PHASE_IMPORTING:
                if data.draw(st.booleans(), label="import delivered"):
                    req = s.requests[ev.request_id]
                    s.import_done(ev.request_id, req.prompt, data.draw(
                        st.integers(0, VOCAB - 1)), events)
                else:
                    s.transfer_failed(ev.request_id, "drawn", events)
            elif ev.kind == "export" and phase == core.PHASE_EXPORTING:
                if data.draw(st.booleans(), label="export sent"):
                    s.export_done(ev.request_id, events)
                else:
                    s.transfer_failed(ev.request_id, "drawn", events)
            else:
                s.stale_or_drained(ev.request_id)
            _check_events(events, ended, pending_pd)
        elif move == "step":
            out = s.schedule()
            while not out.done:
                assert not (out.work and out.call), out  # one or the other
                calls.add(type(out.call))
                assert mixed or not isinstance(out.call, MixedCall)
                out = s.update(_outcome(data, out, s))
            _check_events(list(out.events), ended, pending_pd)
        s.check_invariants()
        assert not s.in_step
        for rid in s.waiting:
            assert s.phase(rid) == core.PHASE_WAITING


def _check_events(events: list[Event], ended: set[int], pending: list[Event]) -> None:
    for ev in events:
        assert ev.request_id not in ended, (ev, "after its end")
        if ev.kind in ("finished", "error"):
            ended.add(ev.request_id)
        elif ev.kind in ("import", "export"):
            pending.append(ev)


def test_step_output_is_plain_data() -> None:
    """What crosses to the executor holds ints and tuples (and the core's own plan), no
    tensors: an engine with another tensor library builds its inputs from it."""
    cfg = Config(lanes=2, kv_blocks=3, max_seq_len=128, prefill_chunk=64)
    s = Scheduler(cfg)
    s.submit([5, 6, 7], 2)
    out = s.schedule()
    assert isinstance(out.call, PrefillCall)
    for name, value in attrs.asdict(out.call, recurse=False).items():
        if name != "effect":
            assert value is None or isinstance(value, (int, tuple)), (name, value)
    out = s.update(StepResult(tokens=(9,), row_errors=(None,)))
    assert out.done and out.events == (Event("token", 0, token=9),)
    out = s.schedule()
    assert isinstance(out.call, DecodeCall) and out.call.ids == (9, 0)
    assert out.call.requests == (0, None) and out.call.padding == (1,)


def test_batcher_steps_match_a_scheduler_driven_beside_it() -> None:
    """The batcher is the scheduler plus a runtime: the same requests through both, the
    scheduler's outcomes taken from the batcher's runtime, give the same events."""
    cfg = Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "dynamic", 1), max_seq_len=128,
                 prefill_chunk=64, prefix_cache=True, scratch="dynamic")
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), keep_ended=None)
    s = Scheduler(cfg, keep_ended=None, vocab_size=b.runtime.vocab_size)
    prompts_ = [[1, 2, 3] * 30, [1, 2, 3] * 30 + [4], [7] * 5]
    for p in prompts_:
        b.submit(p, 4)
        s.submit(p, 4)
    while b.busy():
        events = b.step()
        out = s.schedule()
        while not out.done:
            if out.work:
                out = s.update(StepResult(work=(None,) * len(out.work)))
                continue
            # the tokens the batcher's call produced for the same rows
            toks = tuple(ev.token for ev in events if ev.kind == "token")
            if isinstance(out.call, PrefillCall):
                out = s.update(StepResult(tokens=toks[:1] or (0,), row_errors=(None,)))
            else:
                by_req = {ev.request_id: ev.token for ev in events if ev.kind == "token"}
                out = s.update(StepResult(
                    tokens=tuple(by_req.get(r, 0) if r is not None else 0
                                 for r in out.call.requests),
                    row_errors=(None,) * cfg.lanes))
        assert list(out.events) == events
    assert s.state == b.state


def test_finish_files_a_decoding_request_and_aborts_the_rest() -> None:
    """`finish` (an engine's stop on a token it already has) ends a decoding request as the
    core's own finish does, its blocks becoming prefix-cache entries; a request that is not
    decoding has no finished KV, and is aborted (nothing filed); mid-step it is refused."""
    cfg = Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "dynamic", 2) + 1, max_seq_len=128,
                 block_size=64, prefill_chunk=64, prefix_cache=True)
    s = Scheduler(cfg, vocab_size=VOCAB)
    a = s.submit([1, 2, 3] * 30, 50, EOS)
    b = s.submit([4, 5], 50, EOS)
    while s.phase(a) != core.PHASE_DECODE:
        out = s.schedule()
        while not out.done:
            call = out.call
            n = 1 if call is None or isinstance(call, PrefillCall) else len(call.ids)
            out = s.update(StepResult(work=(None,) * len(out.work)) if call is None
                           else StepResult(tokens=(3,) * n))
        assert s.phase(b) in (core.PHASE_WAITING, core.PHASE_PREFILL, core.PHASE_DECODE)
    out = s.schedule()
    with pytest.raises(RuntimeError, match="step is in progress"):
        s.finish(a)
    while not out.done:
        n = 1 if isinstance(out.call, PrefillCall) else len(out.call.ids) if out.call else 0
        out = s.update(StepResult(tokens=(3,) * n) if out.call else
                       StepResult(work=(None,) * len(out.work)))
    assert s.finish(a) == [Event("finished", a)]
    assert s.phase(a) == core.PHASE_FINISHED
    assert "cache" in s.describe()["blocks"]
    assert s.finish(a) == []  # ended: nothing more
    c = s.submit([7, 8, 9], 5, EOS)  # waiting: aborted, nothing filed
    cached = s.describe()["blocks"].count("cache")
    assert s.finish(c) == [] and s.phase(c) == core.PHASE_ABORTED
    assert s.describe()["blocks"].count("cache") == cached
    s.check_invariants()


def _drive(s: Scheduler, prompts_: list[list[int]]) -> tuple[dict[int, list[int]], set[Any]]:
    """Run to the end with a stand-in model whose next token is a function of the request's
    whole sequence so far, so a request's tokens do not depend on how steps were grouped."""
    def next_token(rid: int) -> int:
        req = s.requests[rid]
        return hash(tuple(req.prompt + req.tokens)) % (VOCAB - 1)  # never EOS

    def row(lane: int) -> int:
        return next_token(s.view.lane_req[lane])

    rids = [s.submit(p, 20, EOS) for p in prompts_]
    calls: set[Any] = set()
    while s.busy():
        out = s.schedule()
        while not out.done:
            call = out.call
            calls.add(type(call))
            if isinstance(call, MixedCall):  # (how many chunks rode along)
                calls.add(("prefills", len(call.prefills)))
            if call is None:
                res = StepResult(work=(None,) * len(out.work))
            else:
                dec = call.decode if isinstance(call, MixedCall) else call
                pres = call.prefills if isinstance(call, MixedCall) else (call,)
                toks: tuple[int, ...] = ()
                if isinstance(dec, DecodeCall):
                    toks += tuple(row(ln) if ln in dec.lanes else 0 for ln in range(len(dec.ids)))
                toks += tuple(row(p.lane) if p.emits else 0 for p in pres
                              if isinstance(p, PrefillCall))
                res = StepResult(tokens=toks)
            out = s.update(res)
        s.check_invariants()
    return {r: s.requests[r].tokens for r in rids}, calls


def test_mixed_calls_give_each_request_the_tokens_separate_calls_give() -> None:
    cfg = Config(lanes=3, kv_blocks=min_kv_blocks(3, True, "dynamic", 4, True), max_seq_len=256,
                 block_size=64, prefill_chunk=64, prefix_cache=True, preemption=True)
    ps = [[1 + i % 5] * (30 + 37 * i) + [i] for i in range(6)]
    apart, calls_apart = _drive(Scheduler(cfg, keep_ended=None), ps)
    together, calls_together = _drive(Scheduler(cfg, keep_ended=None, mixed=True), ps)
    wide, calls_wide = _drive(Scheduler(cfg, keep_ended=None, mixed=True,
                                        prefill_tokens=3 * 64), ps)
    assert together == apart == wide
    assert MixedCall in calls_together and MixedCall not in calls_apart
    assert ("prefills", 1) in calls_together and ("prefills", 2) not in calls_together
    assert ("prefills", 3) in calls_wide


def _run(sched: Scheduler, lanes: int) -> list[Any]:
    """Every step until the scheduler is idle, its work done and its calls answered; the calls."""
    calls = []
    while sched.busy():
        out = sched.schedule()
        while not out.done:
            calls.append(out.call)
            out = sched.update(_succeed(out, lanes))
    return calls


@pytest.mark.parametrize("uncached", [False, True])
def test_an_uncached_request_computes_its_whole_prompt(uncached: bool) -> None:
    """A request that takes no prefix hit (prompt logprobs: every position's logits) is
    admitted with its whole prompt computed, though a cache entry matches it: the scheduler
    discards the entries it would hit (the spec's admission takes any hit there is). Its
    neighbour, asking nothing, takes the hit."""
    cfg = Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "reserved", 2) + 1, max_seq_len=256,
                 block_size=128, prefill_chunk=64, prefix_cache=True)
    sched = Scheduler(cfg, vocab_size=VOCAB)
    shared = [1 + i % 9 for i in range(150)]
    sched.submit(shared, 2)
    _run(sched, cfg.lanes)
    rid = sched.submit(shared + [3], 2, uncached=uncached)
    calls = _run(sched, cfg.lanes)
    starts = [c.start for c in calls if isinstance(c, PrefillCall) and c.request == rid]
    assert starts[0] == (0 if uncached else 128), starts
    assert sched.requests[rid].tokens and sched.requests[rid].error is None
    again = sched.submit(shared + [4], 2)  # the uncached one filed its blocks: a hit again
    calls = _run(sched, cfg.lanes)
    assert [c.start for c in calls if isinstance(c, PrefillCall) and c.request == again][0] \
        == 128
    sched.check_invariants()
    with pytest.raises(ValueError, match="remote"):
        sched.submit(shared, 2, remote=True, uncached=True)
