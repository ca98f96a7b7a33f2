"""A prefill worker that a decode node takes for hung, as the whole cluster sees it
(`LocalCluster`: real workers, links and crypto): the decode node reports which workers (by
process generation), the router chooses them no more and the other decode nodes move what
they asked of them at once, without a deadline of their own; once no decode node reports it
(it answered, it restarted, or its reporter is gone) it is chosen again. Every request ends
once, exactly, and nothing is left behind; nothing is taken from a malformed or hostile
report, and its node is taken for faulty."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from test_cluster import assert_exact, cluster
from test_pd_cluster_audit import assert_at_rest
from test_pd_health_audit import DEADLINE, _Clock, _run_without, _step_without, _steps

from atom_core.pd.cluster import LocalCluster
from atom_core.pd.router import Load, Router

PROMPTS = [list(range(1 + i, 60 + 3 * i)) for i in range(8)]


class _Chosen:
    """The lowest ready prefill worker (the one the tests hang) and the decode worker `decode`
    names (so that the test says which decode node asks what): a policy sees no role, so it
    tells the decode candidates by the router's own load objects."""

    def __init__(self) -> None:
        self.router: Router | None = None
        self.decode = 0

    def choose(self, candidates: Mapping[int, Load], holders: Mapping[int, int]) -> int:
        assert self.router is not None
        loads = self.router.loads["decode"]
        if all(loads.get(w) is ld for w, ld in candidates.items()) and \
                self.decode in candidates:
            return self.decode
        return min(candidates)


def _cluster(prefill: int = 2, decode: int = 2, **kw: Any
             ) -> tuple[LocalCluster, _Clock, _Chosen]:
    clock, policy = _Clock(), _Chosen()
    c = cluster(prefill=prefill, decode=decode, policy=policy,
                decode_options={"clock": clock, "transfer_timeout": DEADLINE}, **kw)
    policy.router = c.frontend.router
    return c, clock, policy


def _submit(c: LocalCluster, policy: _Chosen, decode: int, n: int = 1, at: int = 0
            ) -> list[int]:
    policy.decode = decode
    return [c.submit(PROMPTS[at + i], 4) for i in range(n)]


def _hang_prefill_0(c: LocalCluster, clock: _Clock, policy: _Chosen) -> list[int]:
    """Prefill worker 0 hangs with a request of decode worker 0 on it; its deadline passes:
    decode node 0 takes worker 0 for hung."""
    cids = _submit(c, policy, decode=0)
    _step_without(c, 0, 4)
    assert c.frontend.results[cids[0]].prefill == 0
    clock.t += DEADLINE + 0.5
    _step_without(c, 0, 3)
    assert c.decodes[0].links.unresponsive.keys() == {0}
    return cids


def _avoided(c: LocalCluster) -> frozenset[int]:
    return c.frontend.router.avoided["prefill"]


def _chosen_again(c: LocalCluster, policy: _Chosen, at: int) -> None:
    """Prefill worker 0 runs again: it answers decode node 0's ping, so no one reports it,
    and new requests (from decode node 1) go to it, exactly; nothing is left."""
    _steps(c, 6)
    assert c.decodes[0].links.unresponsive == {} and _avoided(c) == frozenset()
    again = _submit(c, policy, decode=1, n=2, at=at)
    assert [c.frontend.results[x].prefill for x in again] == [0, 0]
    c.run_until_done(rounds=3000)
    assert_exact(c, again)
    assert_at_rest(c)


# --------------------------------------------------------------------------- the router
def test_the_router_stops_choosing_a_reported_hung_prefill_worker_until_it_answers() -> None:
    """Decode node 0 reports prefill worker 0 as not answering (which one, and which process
    of it): the router, whose policy prefers worker 0, chooses worker 1 instead, and the ready
    list the decode nodes get leaves 0 out. It used to keep choosing 0 (each decode node then
    overrode the choice). Once worker 0 runs again and answers decode node 0's ping, nobody
    reports it: it is chosen again. Each request ends once, exactly; nothing is left."""
    c, clock, policy = _cluster()
    first = _hang_prefill_0(c, clock, policy)
    stats = c.frontend.worker_stats[("decode", 0)]
    assert stats["unresponsive_prefill"] == 1 and stats["unresponsive_prefill_ranks"] == [0]
    assert c.frontend.unresponsive[0] == {0: c.prefills[0].gen}
    assert _avoided(c) == {0} and c.frontend.router.ready("prefill") == [0, 1]
    assert c.frontend.router.usable("prefill") == [1]
    more = _submit(c, policy, decode=0, n=2, at=1) + _submit(c, policy, decode=1, n=2, at=3)
    assert [c.frontend.results[x].prefill for x in more] == [1, 1, 1, 1]
    _run_without(c, 0)
    assert_exact(c, first + more)
    _chosen_again(c, policy, at=5)
    assert c.frontend.worker_stats[("decode", 0)]["unresponsive_prefill_ranks"] == []
    assert all(d.links.live() == [0, 1] for d in c.decodes.values())


def test_another_decode_node_moves_its_requests_off_a_reported_worker_at_once() -> None:
    """Decode node 1 asked the hung prefill worker 0 for a request later than decode node 0
    did: when node 0's deadline passes and it reports worker 0, the frontend tells node 1,
    which moves its request to worker 1 at once (cancelled on 0) and never times out, nor
    pings or reports worker 0 itself. It used to wait for a deadline of its own there (with
    the clock stopped here, for ever). The moved request ends once, exactly."""
    c, clock, policy = _cluster()
    a = _submit(c, policy, decode=0)
    _step_without(c, 0, 4)
    clock.t += 3.0
    b = _submit(c, policy, decode=1, at=1)
    _step_without(c, 0, 4)
    assert c.frontend.results[b[0]].prefill == 0
    assert list(c.decodes[1].links._where.values()) == [0]
    clock.t += DEADLINE - 2.5  # a's deadline passes, not b's
    _run_without(c, 0)
    d1 = c.decodes[1].links
    assert d1.moved == 1 and d1.timeouts == 0 and d1.unresponsive == {}
    assert d1.avoided == {0: c.prefills[0].gen} and d1.live() == [1]
    assert c.frontend.unresponsive.get(1) == {}  # node 1 reports only what it saw itself
    assert c.frontend.worker_stats[("decode", 1)]["unresponsive_moved"] == 1
    assert_exact(c, a + b)
    _steps(c, 6)
    assert _avoided(c) == frozenset() and d1.avoided == {} and d1.live() == [0, 1]
    assert_at_rest(c)


def _lone_worker_reported_hung() -> tuple[LocalCluster, _Chosen]:
    """One prefill worker, reported hung by decode node 0 while decode node 1 waits on it too:
    both serve everything locally, exactly; then it runs again and is used again."""
    c, clock, policy = _cluster(prefill=1)
    a = _submit(c, policy, decode=0)
    _step_without(c, 0, 4)
    clock.t += 3.0
    b = _submit(c, policy, decode=1, at=1)
    _step_without(c, 0, 4)
    clock.t += DEADLINE - 2.5
    _step_without(c, 0, 3)
    assert _avoided(c) == {0}
    more = _submit(c, policy, decode=1, n=2, at=2)
    assert [c.frontend.results[x].prefill for x in more] == [None, None]
    _run_without(c, 0)
    assert_exact(c, a + b + more)
    assert c.decodes[1].links.timeouts == 0 and c.decodes[1].worker.lost is not None
    _steps(c, 6)
    assert _avoided(c) == frozenset()
    assert all(d.worker.lost is None and d.links.live() == [0] for d in c.decodes.values())
    return c, policy


def test_the_only_prefill_worker_reported_hung_sends_every_decode_node_to_local_prefill(
        ) -> None:
    """With one prefill worker, reported hung by decode node 0: decode node 1's request on it
    is prefilled locally at once (its worker is told none is left), new requests get no
    prefill worker from the router; all end exactly; once it answers it is used again."""
    c, policy = _lone_worker_reported_hung()
    exports = c.prefills[0].worker.stats.exports
    again = _submit(c, policy, decode=1, n=2, at=4)
    c.run_until_done(rounds=3000)
    assert_exact(c, again)
    assert c.prefills[0].worker.stats.exports > exports
    assert_at_rest(c)


def test_a_decode_node_is_told_again_when_the_worker_it_was_steered_off_is_lost() -> None:
    """Decode node 1 was told no prefill worker is left when the only one was reported hung;
    once no longer set aside, that worker is lost with requests of node 1 on it: node 1's
    worker must be told again (local prefill). It was not (its links kept "told" from before,
    the ready list naming the worker came while it was still set aside), so those requests
    waited for answers that could not come (here, with the deadline clock stopped, for ever)."""
    c, policy = _lone_worker_reported_hung()
    more = _submit(c, policy, decode=1, n=3, at=4)
    _step_without(c, 0, 3)
    assert c.decodes[1].links._where  # asked of worker 0, unanswered
    c.kill("prefill", 0)
    c.run_until_done(rounds=3000)
    assert_exact(c, more)
    assert c.decodes[1].links.timeouts == 0
    assert_at_rest(c)


def test_a_worker_answering_again_is_reported_at_once() -> None:
    """The hung list is a routing signal, not a counter: a report whose only change is that
    list goes out at once, not when counters are next due (here never: the reports' clock is
    stopped), so the worker is chosen again as soon as it answered."""
    c, clock, policy = _cluster(clock=lambda: 0.0)
    first = _hang_prefill_0(c, clock, policy)
    _run_without(c, 0)
    assert_exact(c, first)
    _step_without(c, 0, 3)
    assert _avoided(c) == {0}
    _chosen_again(c, policy, at=2)


# --------------------------------------------------------------------------- who reports
def test_a_restarted_prefill_worker_is_chosen_again_whatever_stale_reports_say() -> None:
    """A report names a process generation: once prefill worker 0 restarted (a new process
    reported ready), a report about its old process (a decode node that has not seen the
    restart yet) sets nothing aside; one about the new process does."""
    c, clock, policy = _cluster()
    first = _hang_prefill_0(c, clock, policy)
    _run_without(c, 0)
    assert_exact(c, first)
    old = c.prefills[0].gen
    c.kill("prefill", 0)
    c.start("prefill", 0)
    _steps(c, 3)
    new = c.prefills[0].gen
    assert new != old and _avoided(c) == frozenset()
    fe = c.frontend
    load = c.decodes[1].load().as_json()
    for gen, aside in [(old, frozenset()), (new, frozenset({0})), (None, frozenset({0}))]:
        fe._on_message("decode", 1, {"kind": "load", "load": load, "stats": {},
                                     "unresponsive": [[0, gen]]})
        fe._tell_ready()
        assert _avoided(c) == aside, gen
    fe._on_message("decode", 1, {"kind": "load", "load": load, "stats": {}})  # (says none)
    fe._tell_ready()
    assert _avoided(c) == frozenset() and fe.router.usable("prefill") == [0, 1]
    more = _submit(c, policy, decode=1, n=2, at=2)
    assert [fe.results[x].prefill for x in more] == [0, 0]
    c.run_until_done(rounds=3000)
    assert_exact(c, more)
    assert_at_rest(c)


def test_a_lost_decode_nodes_report_no_longer_stands() -> None:
    """The decode node that reported prefill worker 0 dies before it hears from 0 again: its
    report goes with it (nobody else would ever withdraw it), and 0 is chosen again."""
    c, clock, policy = _cluster()
    _hang_prefill_0(c, clock, policy)
    assert _avoided(c) == {0}
    c.kill("decode", 0)
    _steps(c, 2)
    assert _avoided(c) == frozenset() and 0 not in c.frontend.unresponsive
    assert c.decodes[1].links.avoided == {} and c.decodes[1].links.live() == [0, 1]
    more = _submit(c, policy, decode=1, n=2, at=2)
    assert [c.frontend.results[x].prefill for x in more] == [0, 0]
    c.run_until_done(rounds=3000)
    assert_exact(c, more)
    _steps(c, 4)
    assert_at_rest(c)
    # a report of the lost one that comes late (it was on its way) does not bring it back
    late = {"kind": "load", "load": Load(False, 0, 0, 0).as_json(), "stats": {},
            "unresponsive": [[0, c.prefills[0].gen]]}
    c.frontend._on_message("decode", 0, late)
    c.frontend._tell_ready()
    assert _avoided(c) == frozenset() and 0 not in c.frontend.unresponsive


# --------------------------------------------------------------------------- totality
HOSTILE: list[Any] = [
    None, 0, "0", {"0": 1}, [0], [[0]], [[0, 1, 2]], [[True, 1]], [[0, True]], [[-1, 1]],
    [[2 ** 31, 1]], [[0, "1"]], [[0.0, 1]], [[0, 1.5]], [["0", 1]], [[[0], 1]],
    [[0, 1]] * 5000, [[[[[[[[]]]]]]]],
]


@pytest.mark.parametrize("bad", HOSTILE, ids=lambda v: repr(v)[:30])
def test_a_malformed_report_is_not_taken_and_its_node_is_faulty(bad: Any) -> None:
    """A ready list sent to a decode node with a list of unresponsive workers that is not one
    is taken as naming none. A decode node's report with such a list: the frontend takes
    nothing from it (its load neither: nothing is taken from a report that is not one),
    takes that node for faulty (`Frontend.faulty`: lost, told to stop) and keeps serving
    with the others."""
    c, _clock, policy = _cluster()
    fe = c.frontend
    fe.controls[("decode", 1)].send({"kind": "prefill_ready", "ranks": [0, 1],
                                     "gens": [c.prefills[0].gen, c.prefills[1].gen],
                                     "unresponsive": bad})
    c.decodes[1].step()
    assert c.decodes[1].links.avoided == {} and c.decodes[1].links.live() == [0, 1]
    sent = Load(True, 7, 1, 1).as_json()
    c.decodes[1].control.send({"kind": "load", "load": sent, "stats": {}, "unresponsive": bad})
    fe.step()
    assert ("decode", 1) in fe.faulty and 1 in fe.router.lost["decode"]
    assert 1 not in fe.router.loads["decode"] and _avoided(c) == frozenset()
    cids = _submit(c, policy, decode=1, n=2)  # (decode node 1 is gone: decode node 0)
    c.run_until_done(rounds=3000)
    assert {fe.results[x].decode for x in cids} == {0}
    assert_exact(c, cids)
    assert_at_rest(c)


def test_a_prefill_nodes_report_of_unresponsive_workers_is_not_taken() -> None:
    """Only decode nodes ask prefill workers: a prefill node naming some as not answering
    sets nothing aside."""
    c, _clock, _policy = _cluster()
    c.prefills[1].control.send({"kind": "load", "load": Load(True, 0, 1, 1).as_json(),
                                "stats": {}, "unresponsive": [[0, c.prefills[0].gen]]})
    c.frontend.step()
    assert _avoided(c) == frozenset() and c.frontend.router.usable("prefill") == [0, 1]
