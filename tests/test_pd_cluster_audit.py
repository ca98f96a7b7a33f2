"""Cluster-level faults of the PD layer (`LocalCluster`, real workers, real crypto with a key):
a prefill worker lost again after the last one rejoined, shutdown with requests in flight,
requests the control links cannot carry, a decode worker that could not serve the
"no prefill worker" case, aborts at every stage and random kills, restarts and aborts. Every
request ends exactly once, with the oracle's tokens or a clear error, within bounded rounds,
and every live worker ends at rest."""

from __future__ import annotations

import random

import pytest
from test_cluster import assert_clean, assert_exact, cluster, config, runtime, submit_workload

from atom_core.demo import oracle_for
from atom_core.pd.cluster import Frontend, LocalCluster

ORACLE = oracle_for(runtime(config()))


def expected(prompt: list[int], n: int) -> list[int]:
    return list(ORACLE.generate(prompt, n))


def assert_at_rest(c: LocalCluster) -> None:
    """`assert_clean`, and nothing left in the routing tables of the links and nodes (an
    entry left there would keep a request's wire id, route or nonce forever)."""
    assert_clean(c)
    for p in c.prefills.values():
        if not p.done:
            assert p.links.pending() == 0 and not p.worker._local
    for d in c.decodes.values():
        if not d.done:
            assert not d.links.busy() and not d.links._assigned and not d.links._cancelled
            assert not d._cid and not d._job


def test_the_last_prefill_worker_lost_after_a_rejoin_sends_its_requests_to_local_prefill(
        ) -> None:
    """Every prefill worker lost (the decode worker is told so, and prefills locally), then
    one reports ready again (the decode worker asks it again), then that one is lost too: its
    unanswered requests must go to local prefill again. The links' "told the worker" mark
    used to be reset only when a link was added, not when a linked worker became ready again,
    so the second loss was never passed on and those requests waited for answers that could
    not come (until the transfer timeout, then failed)."""
    c = cluster(prefill=2, decode=1, decode_options={"transfer_timeout": 3600.0})
    c.kill("prefill", 1)
    c.step()
    c.start("prefill", 1, ready=False)  # linked, not ready: asked nothing
    c.step()
    first = submit_workload(c, n=4)
    c.run_until_done(rounds=2000, each=lambda i: c.kill("prefill", 0) if i == 2 else None)
    assert_exact(c, first)
    d = c.decodes[0]
    assert d.worker.lost is not None  # told: every prefill worker is lost
    c.prefills[1].ready = True
    c.step()
    c.step()
    assert d.worker.lost is None and d.links.live() == [1]  # asked again
    more = submit_workload(c, n=6, seed=3)
    c.step()
    assert c.prefills[1].links.pending() > 0  # it holds requests when it dies
    c.kill("prefill", 1)
    c.run_until_done(rounds=2000)
    assert_exact(c, more)
    assert d.worker.lost is not None and d.resubmitted + d.worker.local_fallbacks > 0
    assert_at_rest(c)


def test_shutdown_ends_every_request_in_flight_and_refuses_new_ones() -> None:
    """A cluster shut down with requests in flight: each ends, with its tokens (it finished
    before) or an error saying so (its workers stop and send nothing more: it used to stay
    open for good, so a caller waiting for `busy()` to clear waited forever); a request
    submitted afterwards is refused at once; every worker is stopped and its links closed."""
    c = cluster(prefill=2, decode=2)
    cids = submit_workload(c, n=12)
    for _ in range(8):
        c.step()
    finished = {cid for cid in cids if c.frontend.results[cid].ended}
    assert finished and len(finished) < len(cids)  # some in flight at shutdown
    c.frontend.shutdown()
    for _ in range(50):  # the workers take the shutdown and stop: nothing more comes
        c.step()
    assert not c.frontend.busy()
    for cid in cids:
        r = c.frontend.results[cid]
        assert r.ended
        if cid in finished:
            assert r.error is None and r.tokens == expected(r.prompt, r.max_new_tokens)
        else:
            assert "shut down" in (r.error or ""), r.error
            # what it generated before is the start of its exact tokens, nothing more
            assert r.tokens == expected(r.prompt, r.max_new_tokens)[:len(r.tokens)]
    late = c.submit([1, 2, 3], 2)
    assert c.frontend.results[late].ended and "shut down" in (c.frontend.results[late].error
                                                              or "")
    c.close()
    assert c.live() == []
    for node in [*c.prefills.values(), *c.decodes.values()]:
        assert not node.control.alive
        assert all(not link.alive for link in node.links.links.values())
    c.step()  # stepping a closed cluster changes nothing
    assert all(c.frontend.results[cid].ended for cid in cids)


def test_a_request_the_control_link_cannot_carry_is_refused_at_submit() -> None:
    """A request whose message is not JSON used to raise out of `submit` after it was counted
    open (it never ended); one larger than the control link's frame limit would end the decode
    worker's control link in a process cluster (its receiver refuses the frame), failing every
    request that worker holds. Both are refused at submit, clearly; the others are served."""
    c = cluster(prefill=1, decode=1)
    ok = submit_workload(c, n=3)
    not_json = c.submit([1, 2, 3], 2, eos=object())  # type: ignore[arg-type]
    huge = c.submit([2 ** 31 - 1] * (c.frontend.max_request_bytes // 10), 2)
    assert "integers" in (c.frontend.results[not_json].error or "")
    assert "too large" in (c.frontend.results[huge].error or "")
    assert c.frontend.results[not_json].ended and c.frontend.results[huge].ended
    c.run_until_done(rounds=2000)
    assert_exact(c, ok)
    assert_at_rest(c)


def test_a_decode_worker_without_local_fallback_is_refused() -> None:
    """The cluster's answer to "no prefill worker is left" is local prefill on the decode
    workers. A decode worker built without it ended a request submitted then inside itself,
    with no event for its node to pass on: the request stayed open for good."""
    with pytest.raises(ValueError, match="fallback_local"):
        cluster(prefill=1, decode=1, decode_options={"fallback_local": False})


@pytest.mark.parametrize("prefetch", [0, 1])
def test_an_abort_at_every_stage_ends_once_and_reaches_the_prefill_worker(prefetch: int
                                                                          ) -> None:
    """An abort sent after 0..N rounds (waiting, prefill asked, prefilling, exported, importing,
    decoding, finished): the request ends once, as "aborted" with a prefix of its tokens or
    exact; the prefill worker dropped it (cancelled, or it had answered already), the decode
    side freed its lane and blocks; the requests around it are exact."""
    a_prompt, b_prompt = list(range(1, 100)), list(range(7, 60))
    cancelled = aborted = 0
    for rounds in (0, 1, 2, 3, 4, 5, 6, 9, 14, 25):  # the stages are in the first rounds
        c = cluster(prefill=1, decode=1, prefetch=prefetch)
        b0 = c.submit(b_prompt, 5)
        a = c.submit(a_prompt, 20)
        b1 = c.submit(b_prompt[:30], 5)
        for _ in range(rounds):
            c.step()
        c.frontend.abort(a)
        c.run_until_done(rounds=1000)
        r = c.frontend.results[a]
        assert r.error in (None, "aborted"), r.error
        want = expected(a_prompt, 20)
        assert r.tokens == (want if r.error is None else want[:len(r.tokens)])
        aborted += r.error == "aborted"
        cancelled += c.prefills[0].worker.stats.cancelled
        assert_exact(c, [b0, b1])
        assert c.frontend.late_events == 0
        assert_at_rest(c)
    assert cancelled > 0 and aborted > 0  # the prefill worker was reached mid-prefill


def run_faults(seed: int) -> None:
    """A random cluster under random kills, (late, not ready) starts, aborts and submits; then
    every request ended within bounded rounds: exact, or an error with a prefix of its exact
    tokens; every live worker at rest."""
    rng = random.Random(seed)
    c = cluster(prefill=rng.randint(1, 3), decode=rng.randint(1, 2),
                prefetch=rng.choice([0, 1, 2]),
                prefill_options={"max_queued": rng.choice([1, 2, 64])})
    system = [rng.randrange(128) for _ in range(64)]

    def prompt() -> list[int]:
        if rng.random() < 0.4:  # a shared prefix: affinity
            return system + [rng.randrange(128) for _ in range(rng.randint(1, 30))]
        return [rng.randrange(128) for _ in range(rng.randint(1, 100))]

    cids = [c.submit(prompt(), rng.randint(1, 20)) for _ in range(6)]
    for i in range(3000):
        if i < 150:
            x = rng.random()
            role = rng.choice(["prefill", "decode"])
            nodes = c.prefills if role == "prefill" else c.decodes
            if x < 0.05:
                live = [k for k, n in nodes.items() if not n.done]
                if live:
                    c.kill(role, rng.choice(live))
            elif x < 0.10:
                dead = [k for k, n in nodes.items() if n.done]
                if dead:
                    c.start(role, rng.choice(dead), ready=rng.random() < 0.6)
            elif x < 0.13:
                for n in c.live():
                    n.ready = True
            elif x < 0.16:
                c.frontend.abort(rng.choice(cids))
            elif x < 0.22:
                cids.append(c.submit(prompt(), rng.randint(1, 20)))
        elif not c.frontend.busy():
            break
        c.step()
    else:
        raise AssertionError(f"seed {seed}: requests still open {sorted(c.frontend._open)}")
    for cid in cids:
        r = c.frontend.results[cid]
        assert r.ended
        want = expected(r.prompt, r.max_new_tokens)
        assert r.tokens == (want if r.error is None else want[:len(r.tokens)]), (seed, cid)
    for n in c.live():
        n.ready = True
    assert_at_rest(c)


@pytest.mark.parametrize("seed", [3, 11, 29])
def test_random_kills_restarts_and_aborts_end_every_request_once(seed: int) -> None:
    run_faults(seed)



def test_the_frontend_bounds_its_open_requests() -> None:
    """Requests beyond `max_open` are refused at once with a clear error (nothing is sent);
    once some end, new ones are taken again, and every taken one is exact."""
    c = cluster(prefill=1, decode=1)
    c.frontend.max_open = 2
    taken = submit_workload(c, n=2)
    refused = c.submit([1, 2, 3], 4)
    r = c.frontend.results[refused]
    assert r.ended and "max_open" in (r.error or "")
    c.run_until_done(rounds=3000)
    again = submit_workload(c, n=1, seed=5)
    c.run_until_done(rounds=3000)
    assert_exact(c, [*taken, *again])
    assert_at_rest(c)
    with pytest.raises(ValueError, match="max_open"):
        Frontend(c.frontend.router, max_open=0)
