"""A PD cluster in one thread (`LocalCluster` over in-process links): N prefill and M decode
workers behind the router serve token-exactly against the oracle, with prefix affinity, through
killed, late and restarted workers; and the per-link muxes' edge cases."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping

import pytest

from atom_core._generated import core
from atom_core.config import Config, min_kv_blocks
from atom_core.demo import oracle_for, workload
from atom_core.pd.cluster import STATS_EVERY, LocalCluster
from atom_core.pd.router import Load, load_of
from atom_core.runtime.reference import TorchReferenceRuntime

KEY = b"cluster-test-key-0123456789abcdef"
S, C = 128, 64


def config(lanes: int = 2, prefix: bool = True) -> Config:
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, "dynamic") + 1,
                  max_seq_len=S, prefill_chunk=C, prefix_cache=prefix)


def runtime(cfg: Config) -> TorchReferenceRuntime:
    return TorchReferenceRuntime.tiny(cfg, seed=0)


def cluster(prefill: int = 2, decode: int = 2, **kw: object) -> LocalCluster:
    kw.setdefault("key", KEY)
    return LocalCluster(config(), runtime, prefill=prefill, decode=decode,  # type: ignore[arg-type]
                        **kw)


def submit_workload(c: LocalCluster, n: int = 12, seed: int = 0) -> list[int]:
    items = workload(n, 6, seed, 128, S)
    return [c.submit(it.prompt, it.max_new_tokens) for it in items]


def assert_exact(c: LocalCluster, cids: list[int], skip_failed: bool = False) -> None:
    oracle = oracle_for(runtime(c.cfg))
    for cid in cids:
        r = c.frontend.results[cid]
        assert r.ended
        if skip_failed and r.error is not None:
            continue
        assert r.error is None, (cid, r.error)
        assert r.tokens == oracle.generate(r.prompt, r.max_new_tokens), cid


def assert_clean(c: LocalCluster) -> None:
    """Every live worker holds nothing: no transfer, no lane, every block free or cached."""
    c.settle()
    for node in c.live():
        b = node.worker.batcher
        assert b.transfers() == {} and not any(b.state.busy)
        assert all(o in (core.OWNER_FREE, core.OWNER_CACHE, core.OWNER_SCRATCH)
                   for o in b.state.owner)
        b.check_invariants()


def test_two_by_two_serves_a_mixed_workload_exactly() -> None:
    c = cluster()
    cids = submit_workload(c)
    c.run_until_done()
    assert_exact(c, cids)
    used = {(r.decode, r.prefill) for r in c.frontend.results.values()}
    assert {d for d, _ in used} == {0, 1} and {p for _, p in used} == {0, 1}
    exports = [c.prefills[p].worker.stats.exports for p in (0, 1)]
    assert sum(exports) == len(cids) and min(exports) > 0
    assert c.frontend.late_events == 0
    assert_clean(c)


class RoundRobin:
    """No affinity: the next worker in turn."""

    def __init__(self) -> None:
        self.n = 0

    def choose(self, candidates: Mapping[int, Load], holders: Mapping[int, int]) -> int:
        self.n += 1
        ws = sorted(candidates)
        return ws[self.n % len(ws)]


def test_prefix_affinity_shows_in_the_prefix_hit_counters() -> None:
    # three system prompts of one chunk each, in turn: round robin over two workers sends each
    # to both (and their small caches keep evicting), affinity keeps each on one
    rng = random.Random(3)
    systems = [[rng.randrange(128) for _ in range(C)] for _ in range(3)]
    prompts = [systems[i % 3] + [rng.randrange(128) for _ in range(rng.randint(1, 40))]
               for i in range(18)]

    def hits(c: LocalCluster) -> int:
        cids = [c.submit(p, 4) for p in prompts]
        c.run_until_done()
        assert_exact(c, cids)
        time.sleep(STATS_EVERY)
        c.step()  # the last reports (counters alone are sent at most every STATS_EVERY)
        return sum(s["prefix_hit_tokens"] for (role, _), s in c.frontend.worker_stats.items()
                   if role == "prefill")

    with_affinity = cluster()
    h_aff = hits(with_affinity)
    h_rr = hits(cluster(policy=RoundRobin()))
    assert with_affinity.frontend.router.affinity_hits["prefill"] > 0
    assert h_aff > h_rr, (h_aff, h_rr)


def test_a_killed_prefill_worker_is_retried_elsewhere() -> None:
    c = cluster(prefetch=2)
    cids = submit_workload(c, n=12)

    def fault(i: int) -> None:
        if i == 3:
            assert c.prefills[0].links.pending() > 0  # it holds requests when it dies
            c.kill("prefill", 0)

    c.run_until_done(each=fault)
    assert_exact(c, cids)
    retried = sum(n.links.retried for n in c.decodes.values())
    assert retried > 0 and c.frontend.late_events == 0
    assert c.frontend.router.ready("prefill") == [1]
    assert sum(n.resubmitted for n in c.decodes.values()) == 0
    assert_clean(c)


def test_every_prefill_worker_killed_falls_back_to_local_prefill() -> None:
    c = cluster(prefill=1, prefetch=1)
    cids = submit_workload(c, n=10)
    c.run_until_done(each=lambda i: c.kill("prefill", 0) if i == 3 else None)
    assert_exact(c, cids)
    assert all(n.worker.lost is not None for n in c.decodes.values())
    local = sum(n.worker.batcher.stats.prefill_tokens for n in c.decodes.values())
    assert local > 0
    # both ways to local prefill were taken: waiting requests made local by the worker, and
    # requests whose transfer failed (no token yet) resubmitted by their node
    assert sum(n.worker.local_fallbacks for n in c.decodes.values()) > 0
    assert sum(n.resubmitted for n in c.decodes.values()) > 0
    assert c.frontend.late_events == 0
    assert_clean(c)
    # new requests are prefilled locally too
    more = submit_workload(c, n=3, seed=5)
    c.run_until_done()
    assert_exact(c, more)


def test_a_killed_decode_worker_fails_its_own_requests_only() -> None:
    c = cluster()
    cids = submit_workload(c, n=12)
    c.run_until_done(each=lambda i: c.kill("decode", 1) if i == 4 else None)
    failed = [cid for cid in cids if c.frontend.results[cid].error is not None]
    assert failed and all(c.frontend.results[cid].decode == 1 for cid in failed)
    assert all("decode worker 1 was lost" in (c.frontend.results[cid].error or "")
               for cid in failed)
    assert_exact(c, cids, skip_failed=True)
    assert c.frontend.router.ready("decode") == [0]
    assert_clean(c)  # the prefill workers dropped what they held for it
    more = submit_workload(c, n=4, seed=7)
    c.run_until_done()
    assert_exact(c, more)
    assert {c.frontend.results[cid].decode for cid in more} == {0}


def test_a_late_prefill_worker_is_used_once_ready() -> None:
    c = cluster(prefill=1, decode=1)
    first = submit_workload(c, n=4)
    c.run_until_done()
    c.start("prefill", 1)
    c.step()
    assert c.frontend.router.ready("prefill") == [0, 1]
    more = submit_workload(c, n=8, seed=1)
    c.run_until_done()
    assert_exact(c, first + more)
    assert c.prefills[1].worker.stats.exports > 0
    assert_clean(c)


def test_a_restarted_worker_is_used_again() -> None:
    c = cluster()
    c.kill("prefill", 1)
    c.kill("decode", 0)
    c.step()
    assert c.frontend.router.ready("prefill") == [0]
    assert c.frontend.router.ready("decode") == [1]
    c.start("prefill", 1)
    c.start("decode", 0)
    c.step()
    assert c.frontend.router.ready("prefill") == [0, 1]
    assert c.frontend.router.ready("decode") == [0, 1]
    cids = submit_workload(c, n=10, seed=2)
    c.run_until_done()
    assert_exact(c, cids)
    assert all(c.prefills[p].worker.stats.exports > 0 for p in (0, 1))
    assert {c.frontend.results[cid].decode for cid in cids} == {0, 1}
    assert_clean(c)


def test_a_key_is_required_unless_insecure() -> None:
    with pytest.raises(ValueError, match="shared key"):
        LocalCluster(config(), runtime, prefill=1, decode=1)
    c = LocalCluster(config(), runtime, prefill=1, decode=1, insecure=True)
    cids = submit_workload(c, n=3)
    c.run_until_done()
    assert_exact(c, cids)


def test_no_decode_worker_fails_the_request_at_once() -> None:
    c = cluster(prefill=1, decode=1)
    c.kill("decode", 0)
    c.step()
    cid = c.submit([1, 2, 3], 2)
    r = c.frontend.results[cid]
    assert r.ended and "no decode worker is ready" in (r.error or "")


def test_a_prompt_that_is_not_token_ids_fails_alone() -> None:
    c = cluster(prefill=1, decode=1)
    bad = c.submit([1, "x", 3], 2)  # type: ignore[list-item]
    good = c.submit([1, 2, 3], 2)
    assert "token ids" in (c.frontend.results[bad].error or "")
    c.run_until_done()
    assert_exact(c, [good])


def test_an_aborted_request_ends_once_and_frees_its_blocks() -> None:
    c = cluster(prefill=1, decode=1)
    a = c.submit(list(range(1, 90)), 40)
    b = c.submit(list(range(5, 50)), 4)
    for _ in range(6):
        c.step()
    assert c.frontend.abort(a)
    c.run_until_done()
    assert c.frontend.results[a].error == "aborted" or c.frontend.results[a].error is None
    assert not c.frontend.abort(a)  # ended
    assert c.decodes[0].links._assigned == {}  # no routing entry outlives its request
    assert_exact(c, [b])
    assert c.frontend.late_events == 0
    assert_clean(c)


def test_workers_that_preempt_serve_exactly() -> None:
    """Both roles with preemption at its (much lower) block minimum: decode workers preempt
    lanes (imported requests among them, which resume by local recompute), prefill workers
    preempt prefills for export (never an exporting lane); every request ends once, exactly."""
    cfg = Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "dynamic", 2, preemption=True),
                 max_seq_len=S, block_size=C, prefill_chunk=C, prefix_cache=True,
                 preemption=True)
    c = LocalCluster(cfg, runtime, prefill=2, decode=2, key=KEY)
    rng = random.Random(3)
    cids = [c.submit([rng.randrange(128) for _ in range(rng.randint(20, 60))], 50)
            for _ in range(10)]
    c.run_until_done()
    assert_exact(c, cids)
    assert sum(d.worker.batcher.stats.preemptions for d in c.decodes.values()) > 0
    assert c.frontend.late_events == 0
    assert_clean(c)


def test_the_frontend_forgets_the_oldest_ended_requests() -> None:
    c = cluster(prefill=1, decode=1)
    c.frontend.keep_ended = 3
    cids = submit_workload(c, n=6)
    c.run_until_done()
    assert len(c.frontend.results) == 3
    assert_exact(c, [cid for cid in cids if cid in c.frontend.results])


def test_a_prefill_worker_that_is_full_has_its_requests_retried_not_failed() -> None:
    """Backpressure: prefill workers holding one request at most (max_queued=1) refuse the
    rest ("busy"); each refused request is asked of the other prefill worker, or, when both
    are full, prefilled locally by its decode worker: none fails, all token-exact."""
    c = cluster(prefetch=2, prefill_options={"max_queued": 1})
    cids = submit_workload(c, n=16)
    c.run_until_done()
    assert_exact(c, cids)
    refused = sum(n.worker.stats.refused_busy for n in c.prefills.values())
    retried = sum(n.links.busy_retried for n in c.decodes.values())
    local = sum(n.busy_local for n in c.decodes.values())
    assert refused > 0 and retried > 0 and local > 0, (refused, retried, local)
    assert all(n.worker.lost is None for n in c.decodes.values())  # nobody was lost
    assert sum(n.worker.stats.exports for n in c.prefills.values()) > 0
    assert c.frontend.late_events == 0
    assert_clean(c)


def test_a_lone_full_prefill_worker_sends_its_refusals_to_local_prefill() -> None:
    c = cluster(prefill=1, decode=1, prefetch=2, prefill_options={"max_queued": 1})
    cids = submit_workload(c, n=8, seed=4)
    c.run_until_done()
    assert_exact(c, cids)
    assert c.decodes[0].links.busy_retried == 0  # no other prefill worker to ask
    assert c.decodes[0].busy_local == c.prefills[0].worker.stats.refused_busy > 0
    assert_clean(c)


def test_the_router_learns_of_every_request_a_worker_took() -> None:
    """A worker reports its load after taking requests even when taking them left its load as
    it was (here: a decode worker refuses prompts too long for it): the router's count of what
    it assigned is corrected, never left inflated (which would steer requests away from an
    idle worker for good)."""
    c = cluster(prefill=1, decode=2)
    for _ in range(3):
        c.submit(list(range(1, S + 10)), 2)  # longer than max_seq_len: refused at once
    c.step()
    assert all(r.ended and "refused" in (r.error or "") for r in c.frontend.results.values())
    for role, nodes in (("prefill", c.prefills), ("decode", c.decodes)):
        for w, node in nodes.items():
            assert c.frontend.router.loads[role][w] == (
                node.load() if role == "decode" else load_of(node.worker.batcher)), (role, w)


def test_a_prefill_worker_is_asked_nothing_until_it_reports_ready() -> None:
    """A restarted prefill worker that is linked but not ready yet: the decode workers prefill
    locally rather than ask it (not even to retry the requests of the one that died), and ask
    it once it reports ready."""
    c = cluster(prefill=2, decode=1)
    c.kill("prefill", 1)
    c.step()
    c.start("prefill", 1, ready=False)
    c.step()
    assert c.frontend.router.ready("prefill") == [0]
    cids = submit_workload(c, n=8)
    c.run_until_done(each=lambda i: c.kill("prefill", 0) if i == 2 else None)
    assert_exact(c, cids)
    assert c.prefills[1].worker.stats.requests == 0
    assert c.decodes[0].worker.local_fallbacks + c.decodes[0].resubmitted > 0
    c.prefills[1].ready = True
    c.step()
    c.step()
    assert c.frontend.router.ready("prefill") == [1]
    more = submit_workload(c, n=4, seed=3)
    c.run_until_done()
    assert_exact(c, more)
    assert c.prefills[1].worker.stats.exports > 0
    assert_clean(c)
