"""The cluster router: load choice, prefix affinity, lost workers skipped, late joiners used
once ready, a custom policy, and load reports checked."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from atom_core.config import Config, min_kv_blocks
from atom_core.pd.router import LeastLoaded, Load, Router, load_of

U = 4  # prefix unit


def ready(queued: int = 0, free_lanes: int = 2, free_blocks: int = 4) -> Load:
    return Load(True, queued, free_lanes, free_blocks)


def router(*, prefill: int = 2, decode: int = 2, **kw: object) -> Router:
    r = Router(U, **kw)  # type: ignore[arg-type]
    for w in range(prefill):
        r.report("prefill", w, ready())
    for w in range(decode):
        r.report("decode", w, ready())
    return r


def test_least_loaded_by_queue_then_lanes_then_blocks_then_id() -> None:
    r = router(decode=3)
    r.report("decode", 0, ready(queued=2))
    r.report("decode", 1, ready(queued=1, free_lanes=1))
    r.report("decode", 2, ready(queued=1, free_lanes=2))
    assert r.assign([1, 2, 3]).decode == 2
    # the assignment counted: worker 2 now holds 2 queued, worker 1 wins on queue
    assert r.assign([5, 6, 7]).decode == 1
    r2 = router(decode=2)
    r2.report("decode", 0, ready(free_blocks=1))
    assert r2.assign([1]).decode == 1  # more free blocks
    r3 = router(decode=2)
    assert r3.assign([1]).decode == 0  # a tie: the lowest id


def test_a_burst_spreads_over_equal_workers() -> None:
    r = router(prefill=2, decode=2)
    got = [r.assign([i, i + 1]) for i in range(0, 8, 2)]  # shorter than a unit: no affinity
    assert sorted(a.decode for a in got) == [0, 0, 1, 1]
    assert sorted(a.prefill for a in got) == [0, 0, 1, 1]  # type: ignore[type-var]


def test_requests_sharing_a_prefix_go_to_the_same_workers() -> None:
    r = router(prefill=2, decode=2, affinity=("prefill", "decode"))
    shared = [9, 9, 9, 9, 8, 8, 8, 8]
    first = r.assign(shared + [1])
    r.assign([50, 51, 52, 53, 54])  # another prompt: takes the other (less loaded) workers
    again = r.assign(shared + [2, 3])
    assert (again.decode, again.prefill) == (first.decode, first.prefill)
    assert r.affinity_hits == {"prefill": 1, "decode": 1}
    # a shorter shared prefix still counts; the longest one wins
    r.report("prefill", 0, ready())
    r.report("prefill", 1, ready())
    r._seen["prefill"][1 - first.prefill][r.prefix_keys([9, 9, 9, 9])[0]] = 1  # type: ignore
    assert r.pick("prefill", r.prefix_keys(shared + [7])) == first.prefill


def test_affinity_yields_to_load_beyond_the_slack() -> None:
    r = router(prefill=2, policy=LeastLoaded(slack=1))
    p = [1, 2, 3, 4, 5]
    w = r.assign(p).prefill
    assert w is not None
    r.report("prefill", w, ready(queued=3))
    r.report("prefill", 1 - w, ready(queued=1))
    assert r.assign(p).prefill == 1 - w  # 3 > 1 + 1: the queue wins
    r.report("prefill", w, ready(queued=2))
    r.report("prefill", 1 - w, ready(queued=1))
    assert r.assign(p).prefill == w  # 2 <= 1 + 1: affinity wins


def test_lost_workers_are_skipped_until_they_report_ready() -> None:
    r = router(prefill=2, decode=2)
    r.mark_lost("decode", 0)
    r.mark_lost("prefill", 1)
    for i in range(4):
        a = r.assign([i])
        assert (a.decode, a.prefill) == (1, 0)
    r.report("decode", 0, Load(False))  # a late report from before the loss: still gone
    assert r.ready("decode") == [1]
    r.report("decode", 0, ready())  # restarted and ready: used again
    assert r.assign([99]).decode == 0
    r.mark_lost("prefill", 0)
    assert r.assign([1]).prefill is None  # no prefill worker: the decode worker prefills
    r.mark_lost("decode", 0)
    r.mark_lost("decode", 1)
    with pytest.raises(RuntimeError, match="no decode worker is ready"):
        r.assign([1])


def test_a_late_joiner_is_used_once_it_reports_ready() -> None:
    r = router(prefill=1, decode=1)
    r.report("prefill", 7, Load(False))  # joined, still loading its model
    assert all(r.assign([i]).prefill == 0 for i in range(3))
    r.report("prefill", 7, ready())
    assert r.assign([42]).prefill == 7  # the least loaded now
    r.report("decode", 3, ready())
    assert r.assign([43]).decode == 3


def test_a_restarted_worker_forgets_its_prefixes() -> None:
    r = router(prefill=2)
    p = [1, 2, 3, 4, 5]
    w = r.assign(p).prefill
    assert w is not None
    r.mark_lost("prefill", w)
    r.report("prefill", w, ready())
    assert r._holders("prefill", r.prefix_keys(p), r.loads["prefill"]) == {}


def test_a_custom_policy_is_used_and_checked() -> None:
    class Highest:
        def choose(self, candidates: Mapping[int, Load], holders: Mapping[int, int]) -> int:
            return max(candidates)

    r = router(prefill=3, decode=3, policy=Highest())
    assert r.assign([1]) == r.assign([1]) and r.assign([2]).decode == 2

    class Wrong:
        def choose(self, candidates: Mapping[int, Load], holders: Mapping[int, int]) -> int:
            return 99

    with pytest.raises(ValueError, match="chose worker 99"):
        router(policy=Wrong()).assign([1])


def test_prefix_keys_are_a_bounded_chain() -> None:
    r = Router(U)
    a, b = r.prefix_keys([1, 2, 3, 4, 5, 6, 7, 8, 9]), r.prefix_keys([1, 2, 3, 4, 5, 6, 7, 0])
    assert len(a) == 2 and len(b) == 2 and a[0] == b[0] and a[1] != b[1]
    assert r.prefix_keys([1, 2, 3]) == []
    assert len(r.prefix_keys(list(range(10_000)))) == 16


def test_load_reports_are_checked_and_bad_arguments_refused() -> None:
    ld = Load(True, 1, 2, 3)
    assert Load.from_json(ld.as_json()) == ld
    for bad in ({}, {"ready": 1, "queued": 0, "free_lanes": 0, "free_blocks": 0},
                {"ready": True, "queued": -1, "free_lanes": 0, "free_blocks": 0},
                {**ld.as_json(), "x": 1}, [1]):
        with pytest.raises(ValueError):
            Load.from_json(bad)
    with pytest.raises(ValueError, match="prefix_unit"):
        Router(0)
    with pytest.raises(ValueError, match="role"):
        Router(U).report("router", 0, ld)


def test_load_of_a_batcher() -> None:
    from atom_core.batcher import AtomBatcher
    from atom_core.runtime.reference import TorchReferenceRuntime

    cfg = Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "dynamic") + 1, max_seq_len=128,
                 prefill_chunk=64, prefix_cache=True)
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg))
    idle = load_of(b)
    assert idle == Load(True, 0, 2, cfg.kv_blocks)  # dynamic scratch: no block set aside
    for i in range(3):
        b.submit([i + 1] * 10, 2)
    b.step()
    busy = load_of(b, held=1)
    assert busy.queued == 2 and busy.free_lanes == 0  # two lanes taken, one waits (+1 held)


def test_bench_router_cost_runs() -> None:
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # bench/ is a top-level directory, not an installed package
        sys.path.insert(0, root)
    from bench.cluster import router_cost

    out = router_cost(n=200)
    assert 0 < out["median_us"] <= out["p90_us"]


def test_decode_workers_are_chosen_by_load_alone_by_default() -> None:
    r = router(prefill=2, decode=2)
    p = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a, b = r.assign(p), r.assign(p)
    assert a.prefill == b.prefill and a.decode != b.decode
    assert r.affinity_hits == {"prefill": 1, "decode": 0}
    with pytest.raises(ValueError, match="role"):
        Router(U, affinity=("router",))
