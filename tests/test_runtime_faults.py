"""Runtime calls that fail outside prefill, decode and copy: host-buffer allocation (host memory
ran out) and a runtime whose every call raises.

Each scenario failed on the adapter before its fix: an allocation outside the failure path left
a block SPILLING (or a prefill half-applied) and every later `step()` raised or waited forever.
Now: `step()` never raises for a runtime fault, every request ends exactly once, every request
that finishes is token-exact, and at the end every block and host slot is at rest.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config, ConfigError, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.runtime import TorchReferenceRuntime

C, V = 64, 128
HYBRID_MODEL = {"layers": 3, "global_every": 3}


class HostMemoryGone(MemoryError):
    pass


class NoHostMemory:
    """Delegates to `inner`; the host-buffer allocations named in `fail` raise from their call
    number `after` on (counted per allocation kind, from 0)."""

    def __init__(self, inner: TorchReferenceRuntime, fail: tuple[str, ...], after: int = 0):
        self.inner, self.fail, self.after = inner, fail, after
        self.calls = dict.fromkeys(fail, 0)
        self.raised = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _alloc(self, name: str) -> Any:
        if name in self.fail:
            self.calls[name] += 1
            if self.calls[name] > self.after:
                self.raised += 1
                raise HostMemoryGone(f"{name}: host memory exhausted")
        return getattr(self.inner, name)()

    def new_host_buffer(self) -> Any:
        return self._alloc("new_host_buffer")

    def new_local_host_buffer(self) -> Any:
        return self._alloc("new_local_host_buffer")


class EverythingFails:
    """A runtime whose every method raises (its attributes, e.g. num_blocks, still read)."""

    def __init__(self, inner: TorchReferenceRuntime) -> None:
        self.inner = inner
        self.raised: list[str] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value):
            return value

        def fail(*_args: Any, **_kwargs: Any) -> Any:
            self.raised.append(name)
            raise RuntimeError(f"device lost ({name})")
        return fail


def workload(seed: int, n: int, seq_len: int) -> list[tuple[list[int], int]]:
    """Shared system prompts (so entries are cached, spilled and hit) and unrelated prompts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(V) for _ in range(rng.choice([70, 140, 200]))] for _ in range(3)]
    out = []
    for i in range(n):
        if i % 3 == 2:
            p = [rng.randrange(V) for _ in range(rng.randint(1, seq_len // 2))]
        else:
            p = rng.choice(systems) + [rng.randrange(V) for _ in range(rng.randint(1, 30))]
        out.append((p[:seq_len - 20], rng.randint(1, 8)))
    return out


def drive(b: AtomBatcher, work: list[tuple[list[int], int]]) -> list[Event]:
    rids = [b.submit(p, n) for p, n in work]
    log: list[Event] = []
    for _ in range(5000):
        if not b.busy():
            break
        log.extend(b.step())  # never raises: that is the first thing under test
        b.check_invariants()
    assert not b.busy(), "requests never ended"
    for rid in rids:  # each request ended exactly once
        ends = [e for e in log if e.request_id == rid and e.kind in ("finished", "error")]
        assert len(ends) == 1 and b.requests[rid].ended, (rid, ends)
    return log


def at_rest(b: AtomBatcher) -> None:
    s = b.state
    for blk in range(s.consts.K):
        assert s.owner[blk] in (core.OWNER_FREE, core.OWNER_CACHE, core.OWNER_SCRATCH), \
            (blk, core.OWNER_NAMES[s.owner[blk]])
    for h in range(s.consts.H):
        assert core.SLOTSTATE_NAMES[s.slot_state[h]] in ("EMPTY", "STORED"), h


def token_exact(b: AtomBatcher, inner: TorchReferenceRuntime) -> int:
    oracle = oracle_for(inner)
    done = 0
    for r in b.requests.values():
        want = oracle.generate(r.prompt, r.max_new_tokens)
        if r.error is None:
            assert r.tokens == want, r.id
            done += 1
        else:
            assert r.tokens == want[:len(r.tokens)], r.id
    return done


def host_config(lanes: int = 2, paged: bool = True, host: int = 2) -> Config:
    seq, block = (512, 128) if paged else (256, 256)
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, True, "dynamic", seq // block),
                  max_seq_len=seq, block_size=block, prefill_chunk=C, prefix_cache=True,
                  host_cache_blocks=host)


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("after", [0, 1])
def test_spill_allocation_failure_drops_only_the_entry(paged: bool, after: int) -> None:
    """Host memory runs out when the host tier stores an evicted entry: the store fails (the
    core's `store_fail`), the entry is lost, its block is free, and every request finishes."""
    cfg = host_config(paged=paged)
    inner = TorchReferenceRuntime.tiny(cfg)
    rt = NoHostMemory(inner, ("new_host_buffer",), after=after)
    b = AtomBatcher(cfg, rt, ghost=True)
    drive(b, workload(3, 14, cfg.max_seq_len))
    assert rt.raised > 0 and b.stats.host_store_failures == rt.raised
    assert token_exact(b, inner) == len(b.requests)  # a lost entry fails no request
    at_rest(b)
    assert b.stats.host_stores == after  # the stores before memory ran out


@pytest.mark.parametrize("after", [0, 2])
def test_snapshot_allocation_failure_costs_only_later_hits(after: int) -> None:
    """Host memory runs out for a hybrid model's sliding-window snapshot at a chunk boundary
    (the prompt's last chunk included): the prefill stands, the request gets its first token,
    later hits just have fewer snapshots to restore from."""
    cfg = Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "dynamic") + 1, max_seq_len=256,
                 prefill_chunk=C, prefix_cache=True, sliding_window=16)
    inner = TorchReferenceRuntime.tiny(cfg, sliding_window=16, **HYBRID_MODEL)
    rt = NoHostMemory(inner, ("new_local_host_buffer",), after=after)
    b = AtomBatcher(cfg, rt, ghost=True)
    drive(b, workload(5, 12, cfg.max_seq_len))
    assert rt.raised > 0 and b.stats.snapshot_failures == rt.raised
    assert b.stats.snapshots == after
    assert token_exact(b, inner) == len(b.requests)
    at_rest(b)


CONFIGS = {
    "eager-prefix-reserved": lambda: Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "reserved"),
                                            max_seq_len=256, prefill_chunk=C, prefix_cache=True,
                                            scratch="reserved"),
    "paged-host": lambda: host_config(lanes=2, paged=True, host=2),
    "paged-preemption": lambda: Config(lanes=3, kv_blocks=min_kv_blocks(3, False, "dynamic", 4,
                                                                        True),
                                       max_seq_len=256, block_size=64, prefill_chunk=C,
                                       preemption=True),
    "hybrid-prefix": lambda: Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "dynamic") + 1,
                                    max_seq_len=256, prefill_chunk=C, prefix_cache=True,
                                    sliding_window=16),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_runtime_that_always_fails_ends_every_request_with_an_error(name: str) -> None:
    cfg = CONFIGS[name]()
    model = {"sliding_window": 16, **HYBRID_MODEL} if cfg.sliding_window else {}
    rt = EverythingFails(TorchReferenceRuntime.tiny(cfg, **model))
    b = AtomBatcher(cfg, rt, ghost=True)
    log = drive(b, workload(11, 9, cfg.max_seq_len))
    assert rt.raised and "prefill" in rt.raised
    assert all(r.error is not None and r.tokens == [] for r in b.requests.values())
    assert sum(e.kind == "error" for e in log) == len(b.requests)
    at_rest(b)
    # and the batcher still takes work (which fails the same way, cleanly)
    drive(b, workload(12, 2, cfg.max_seq_len))
    at_rest(b)


def test_config_refuses_ids_the_runtime_int16_tables_cannot_hold() -> None:
    with pytest.raises(ConfigError, match="int16-ids.*kv_blocks=40000"):
        Config(lanes=2, kv_blocks=40000, scratch="reserved")
    with pytest.raises(ConfigError, match="int16-ids.*host_cache_blocks=40000"):
        Config(lanes=2, kv_blocks=8, prefix_cache=True, host_cache_blocks=40000)
    # the largest addressable: block ids 0..32767
    assert Config(lanes=2, kv_blocks=2**15, scratch="reserved").scratch_id == 2**15 - 1


# --------------------------------------------------------------------------- long-running
@pytest.mark.parametrize("keep", [0, 3])
def test_memory_does_not_grow_with_requests_served(keep: int) -> None:
    """A batcher keeps the last `keep_ended` ended requests: older ones are forgotten through
    the core (their prompts leave the core's state), and the trace still replays."""
    import io

    from atom_core.replay import replay

    cfg = Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "dynamic") + 1, max_seq_len=256,
                 prefill_chunk=C, prefix_cache=True)
    inner = TorchReferenceRuntime.tiny(cfg)
    trace = io.StringIO()
    b = AtomBatcher(cfg, inner, ghost=True, trace=trace, keep_ended=keep)
    oracle = oracle_for(inner)
    work = workload(21, 40, cfg.max_seq_len)
    ended: set[int] = set()
    streamed: dict[int, list[int]] = {}
    for p, n in work:
        rid = b.submit(p, n)
        if rid % 3 == 1:
            b.abort(rid - 1)
        for _ in range(3):
            for ev in b.step():  # a server streams tokens from the events
                if ev.kind == "token":
                    streamed.setdefault(ev.request_id, []).append(ev.token)
                elif ev.kind == "finished":
                    ended.add(ev.request_id)
        assert len([r for r in b.requests.values() if r.ended]) <= keep
        assert len(b.state.prompt) <= keep + cfg.lanes + len(b.waiting)
    while b.busy():
        for ev in b.step():
            if ev.kind == "token":
                streamed.setdefault(ev.request_id, []).append(ev.token)
            elif ev.kind == "finished":
                ended.add(ev.request_id)
    assert len(b.requests) == keep and b.stats.forgotten == len(work) - keep
    assert len(b.state.prompt) == keep and len(b.state.phase) == keep
    assert len(ended) > len(work) // 2
    for rid in ended:
        assert streamed[rid] == oracle.generate(work[rid][0], work[rid][1])
    assert replay(trace.getvalue().splitlines()).ok
    with pytest.raises(ValueError, match="keep_ended"):
        AtomBatcher(cfg, inner, keep_ended=-1)


@pytest.mark.parametrize("when", [0, 2])
def test_a_failing_sampler_fails_only_its_request(when: int) -> None:
    """A request's host-side sampler raising (at its first token: prefill, or later: decode)
    or returning a token outside the vocabulary ends that request alone."""
    cfg = Config(lanes=3, kv_blocks=min_kv_blocks(3, True, "dynamic") + 1, max_seq_len=256,
                 prefill_chunk=C, prefix_cache=True)
    inner = TorchReferenceRuntime.tiny(cfg)
    calls = {"raise": 0, "range": 0}

    def bad(kind: str):
        def sampler(logits: Any) -> int:
            calls[kind] += 1
            if calls[kind] > when:
                if kind == "raise":
                    raise RuntimeError("sampler bug")
                return 10**6
            return int(logits.argmax())
        return sampler

    b = AtomBatcher(cfg, inner, ghost=True)
    work = workload(8, 6, cfg.max_seq_len)
    rids = [b.submit(p, 6, sampler=bad("raise") if i == 1 else bad("range") if i == 4 else None)
            for i, (p, _) in enumerate(work)]
    while b.busy():
        b.step()
        b.check_invariants()
    oracle = oracle_for(inner)
    for i, rid in enumerate(rids):
        r = b.requests[rid]
        want = oracle.generate(work[i][0], 6)
        if i in (1, 4):
            assert r.error.startswith("sampler failed") and r.tokens == want[:when], r
        else:
            assert r.error is None and r.tokens == want
    at_rest(b)
