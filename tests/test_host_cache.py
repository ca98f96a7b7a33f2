"""The host cache tier: device cache entries evicted into host slots, loaded back on a hit.

- Token-exact against the oracle on workloads whose shared prefixes outnumber the device cache,
  for 1..2 lanes and both scratch disciplines at the proved minimum of blocks, with host hits
  actually taken and invariants (ghost included) after every step; at rest no slot is mid-store
  or mid-load and no block is pinned.
- The host tier saves prefill tokens on such a workload (with H = 0 as the baseline).
- Faults: a failed store drops only that entry; a failed load makes only its request recompute
  its prompt (still token-exact); a host slot is never evicted while a load reads it.
- Config: host_cache_blocks needs the prefix cache, is refused for hybrid models, must be an
  int >= 0; a runtime without host transfers is refused.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from atom_core._generated import core
from atom_core.batcher import AtomBatcher
from atom_core.config import Config, ConfigError, min_kv_blocks
from atom_core.demo import oracle_for
from atom_core.runtime import TorchReferenceRuntime
from atom_core.seq import seq

S, C, V = 256, 64, 128


def config(lanes: int, scratch: str = "dynamic", host: int = 4, extra: int = 0) -> Config:
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, True, scratch) + extra,
                  max_seq_len=S, prefill_chunk=C, prefix_cache=True, scratch=scratch,
                  host_cache_blocks=host)


def batcher(cfg: Config, ghost: bool = True) -> AtomBatcher:
    return AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg, seed=0, layers=2), ghost=ghost)


def workload(seed: int, groups: int = 5, n: int = 20) -> list[tuple[list[int], int]]:
    """Requests drawn from `groups` system prompts (one to two chunks and a bit), each with its
    own suffix: more shared prefixes than the device cache holds."""
    rng = random.Random(seed)
    systems = [[rng.randrange(V) for _ in range(rng.choice([70, 130, 150]))]
               for _ in range(groups)]
    return [(rng.choice(systems) + [rng.randrange(V) for _ in range(rng.randint(1, 40))],
             rng.randint(1, 8)) for _ in range(n)]


def run_checked(b: AtomBatcher, work: list[tuple[list[int], int]]) -> list[int]:
    rids = [b.submit(p, n) for p, n in work]
    steps = 0
    while b.busy():
        b.step()
        b.check_invariants()
        steps += 1
        assert steps < 5000
    return rids


def mismatches(b: AtomBatcher, rids: list[int]) -> list[int]:
    o = oracle_for(b.runtime)
    return [r for r in rids if b.requests[r].tokens != o.generate(
        b.requests[r].prompt, b.requests[r].max_new_tokens, None)]


def assert_at_rest(b: AtomBatcher) -> None:
    s = core.describe_state(b.state)
    assert set(s["owner"]) <= {"FREE", "CACHE", "SCRATCH"}, s["owner"]
    assert set(s["slot_state"]) <= {"EMPTY", "STORED"}, s["slot_state"]


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("lanes", [1, 2])
def test_host_round_trips_are_token_exact(lanes: int, scratch: str) -> None:
    b = batcher(config(lanes, scratch))
    rids = run_checked(b, workload(lanes))
    assert all(b.requests[r].error is None for r in rids)
    assert mismatches(b, rids) == []
    assert b.stats.host_stores > 0 and b.stats.host_hit_tokens >= C
    assert_at_rest(b)


def test_a_full_host_tier_evicts_its_least_recently_used_entry() -> None:
    b = batcher(config(1, host=1))
    rids = run_checked(b, workload(4))
    assert mismatches(b, rids) == []
    assert b.stats.host_stores > 1  # one slot, several entries over time: evictions happened
    assert_at_rest(b)


class Flaky:
    """Runtime wrapper failing chosen calls (1-based) of one method."""

    def __init__(self, inner: TorchReferenceRuntime, op: str, fail_calls: set[int]) -> None:
        self.inner, self.op, self.fail_calls, self.calls = inner, op, fail_calls, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != self.op:
            return attr

        def call(*args: Any) -> Any:
            self.calls += 1
            if self.calls in self.fail_calls:
                raise RuntimeError(f"injected {name} failure")
            return attr(*args)
        return call


def test_failed_stores_drop_only_their_entries() -> None:
    b = batcher(config(2))
    b.runtime = Flaky(b.runtime, "fetch_kv_cache", {1, 3, 4})
    rids = run_checked(b, workload(5))
    assert b.stats.host_store_failures == 3
    assert all(b.requests[r].error is None for r in rids)
    assert mismatches(b, rids) == []
    assert_at_rest(b)


def test_failed_load_recomputes_only_its_request() -> None:
    work = workload(6)
    clean = batcher(config(2))
    run_checked(clean, work)
    assert clean.stats.host_hit_tokens > 0
    b = batcher(config(2))
    # update_kv_cache is only used by host loads here (no PD): fail the first one
    b.runtime = Flaky(b.runtime, "update_kv_cache", {1})
    rids = run_checked(b, work)
    assert b.stats.host_load_failures == 1
    assert all(b.requests[r].error is None for r in rids)
    assert mismatches(b, rids) == []
    # the failed load's tokens were computed instead
    assert b.stats.prefill_tokens > clean.stats.prefill_tokens
    assert_at_rest(b)


def test_a_loading_slot_is_never_evicted_or_overwritten() -> None:
    """The core refuses host_evict and spill into a slot a load is reading."""
    cfg = config(1, host=1, extra=1)  # (a second block for the host hit to load into)
    s = core.init(cfg.consts(), ghost=True)
    p = seq(range(1, 140))

    def apply(st: Any, name: str, **args: Any) -> Any:
        step = core.ACTIONS[name][0](st, **args)
        assert step.rejected is None, (name, step.rejected)
        return step.state

    s = apply(s, "submit", r=0, p=p)
    s = apply(s, "admit_miss", l=0, r=0, dst=0)
    for _ in range(3):
        s = apply(s, "prefill", l=0, tok=5)
    s = apply(s, "finish", l=0, keep=True)
    s = apply(s, "spill", b=0, h=0)
    assert core.host_evict_guard(s, 0) == "slot_stored"  # a store is writing it
    s = apply(s, "store_done", h=0)
    s = apply(s, "submit", r=1, p=p)
    s = apply(s, "admit_host_hit", l=0, r=1, h=0, dst=1, n=2 * C)
    assert core.host_evict_guard(s, 0) == "slot_stored"
    s = apply(s, "submit", r=2, p=p)
    assert core.admit_host_hit_guard(s, 0, 2, 0, 0, C) == "lane_idle"
    s = apply(s, "load_done", l=0)
    assert core.host_evict_guard(s, 0) is None
    assert core.check_invariants(s) == []


# ------------------------------------------------------------------ paged tables (T > 1)
PS, PB = 512, 128  # max_seq_len and block size: tables of 4 blocks


def paged_config(lanes: int, scratch: str = "dynamic", host: int = 8) -> Config:
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, True, scratch, PS // PB),
                  max_seq_len=PS, block_size=PB, prefill_chunk=C, prefix_cache=True,
                  scratch=scratch, host_cache_blocks=host)


def paged_workload(seed: int, groups: int = 4, n: int = 16) -> list[tuple[list[int], int]]:
    """Shared system prompts of two to three blocks, each request with its own suffix: hits
    span several blocks, and the shared blocks outnumber the device cache."""
    rng = random.Random(seed)
    systems = [[rng.randrange(V) for _ in range(rng.choice([200, 290, 330]))]
               for _ in range(groups)]
    return [(rng.choice(systems) + [rng.randrange(V) for _ in range(rng.randint(1, 40))],
             rng.randint(1, 8)) for _ in range(n)]


def count_later_loads(b: AtomBatcher) -> dict[str, int]:
    """Counts the batcher's host hits past a table's first block (`grow_hit_host`) as they
    are applied, and the tokens they load."""
    seen = {"loads": 0, "tokens": 0}
    apply = b.scheduler._apply  # (the scheduler applies every transition)

    def counting(action: str, **args: Any) -> Any:
        step = apply(action, **args)
        if action == "grow_host_hit":
            seen["loads"] += 1
            seen["tokens"] += args["n"]
        return step
    b.scheduler._apply = counting  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("scratch", ["reserved", "dynamic"])
@pytest.mark.parametrize("lanes", [1, 2])
def test_paged_host_round_trips_are_token_exact(lanes: int, scratch: str) -> None:
    """Tables of 4 blocks at the proved minimum of device blocks: entries of every position
    go to the host tier and come back, into first blocks (`admit_host_hit`) and later ones
    (`grow_host_hit`), and every request's tokens are the oracle's."""
    b = batcher(paged_config(lanes, scratch))
    later = count_later_loads(b)
    rids = run_checked(b, paged_workload(lanes))
    assert all(b.requests[r].error is None for r in rids)
    assert mismatches(b, rids) == []
    assert later["loads"] > 0 and b.stats.host_hit_tokens > later["tokens"] > 0
    assert_at_rest(b)


@pytest.mark.parametrize("paged", [False, True], ids=["one-block", "paged"])
def test_host_tier_saves_prefill_tokens(paged: bool) -> None:
    """A working set larger than the device cache (one block per sequence: 6 shared prompts of
    one to two chunks; paged: 4 of 2-3 blocks, tables of 4): the host tier turns recomputed
    prefixes into loads, and every prompt token is computed, copied or loaded exactly once."""
    if paged:
        work, make = paged_workload(3, groups=4, n=24), paged_config
        without, with_host = make(2, host=0), make(2, host=12)
    else:
        work, make = workload(3, groups=6, n=30), config
        without, with_host = make(2, host=0), make(2, host=6)
    total = sum(len(p) for p, _ in work)
    runs = [batcher(cfg, ghost=False) for cfg in (without, with_host)]
    rids = [run_checked(b, work) for b in runs]
    assert mismatches(runs[1], rids[1]) == []
    for b in runs:
        st = b.stats
        assert st.prefill_tokens + st.prefix_hit_tokens + st.host_hit_tokens == total
    assert runs[0].stats.host_hit_tokens == 0 and runs[1].stats.host_hit_tokens > 0
    assert runs[1].stats.prefill_tokens < runs[0].stats.prefill_tokens


def test_failed_load_into_a_later_block_recomputes_only_that_block() -> None:
    """A load into a table's later block fails: its request recomputes exactly the tokens that
    load would have brought (the blocks before it keep theirs), and every answer is exact."""
    work = paged_workload(6)
    clean = batcher(paged_config(2))
    clean_later = count_later_loads(clean)
    run_checked(clean, work)
    assert clean_later["loads"] > 0
    b = batcher(paged_config(2))
    loads: list[int] = []  # the n of each load, in order
    rt = b.runtime
    update = rt.update_kv_cache
    later = count_later_loads(b)
    apply = b.scheduler._apply  # (the scheduler applies every transition)

    def watch(action: str, **args: Any) -> Any:
        if action in ("admit_host_hit", "grow_host_hit"):
            loads.append(args["n"] if action == "admit_host_hit" else -args["n"])
        return apply(action, **args)
    b.scheduler._apply = watch  # type: ignore[method-assign]

    def fail_first_later_load(host: Any, block: int) -> None:
        if loads and loads[-1] < 0 and not failed:
            failed.append(-loads[-1])
            raise RuntimeError("injected update_kv_cache failure")
        update(host, block)
    failed: list[int] = []
    rt.update_kv_cache = fail_first_later_load  # type: ignore[method-assign]
    rids = run_checked(b, work)
    assert failed and b.stats.host_load_failures == 1
    assert all(b.requests[r].error is None for r in rids)
    assert mismatches(b, rids) == []
    # only that load's tokens were computed instead (the rest of the run is the clean one's)
    assert b.stats.prefill_tokens == clean.stats.prefill_tokens + failed[0]
    assert b.stats.host_hit_tokens == clean.stats.host_hit_tokens - failed[0]
    assert later["loads"] == clean_later["loads"]
    assert_at_rest(b)


@pytest.mark.parametrize("kwargs,fix", [
    ({"prefix_cache": False, "host_cache_blocks": 2}, "prefix_cache=True"),
    ({"prefix_cache": True, "host_cache_blocks": 2, "sliding_window": 16}, "host_cache_blocks=0"),
    ({"prefix_cache": True, "host_cache_blocks": -1}, "integer >= 0"),
    ({"prefix_cache": True, "host_cache_blocks": True}, "integer >= 0"),
])
def test_config_rejects_unsupported_host_tiers(kwargs: dict[str, Any], fix: str) -> None:
    with pytest.raises(ConfigError) as e:
        Config(lanes=1, kv_blocks=4, max_seq_len=S, prefill_chunk=C, **kwargs)
    assert fix in str(e.value)


def test_runtime_without_host_transfers_is_refused() -> None:
    cfg = config(1)
    rt = TorchReferenceRuntime.tiny(cfg, seed=0, layers=2)

    class NoHost:
        def __getattr__(self, name: str) -> Any:
            if name in ("fetch_kv_cache", "update_kv_cache", "new_host_buffer"):
                raise AttributeError(name)
            return getattr(rt, name)

    with pytest.raises(ValueError, match="host_cache_blocks"):
        AtomBatcher(cfg, NoHost())


def test_a_spill_does_not_delay_admission() -> None:
    """When the block an admission takes is a cache entry, the batcher stores the entry to the
    host and chooses again in the same step: the request does not wait a step for its lane."""
    b = batcher(config(1, "dynamic", extra=1))
    rng = random.Random(7)
    for _ in range(2):  # two distinct cached prompts: every device block is a cache entry
        run_checked(b, [([rng.randrange(V) for _ in range(130)], 1)])
    assert set(core.describe_state(b.state)["owner"]) == {"CACHE"}
    rid = b.submit([rng.randrange(V) for _ in range(130)], 1)
    b.step()
    b.check_invariants()
    assert b.stats.host_stores == 1
    assert rid not in b.waiting  # admitted in the step that spilled
