"""Restarts, crashes and slow workers in a PD cluster (`LocalCluster`, real workers and crypto):
a restarted prefill worker is asked nothing (retries included) until that very process reports
ready; every request ends once, with the oracle's tokens or one clear error; no block, routing
entry or router count outlives its request."""

from __future__ import annotations

from test_cluster import assert_exact, cluster, submit_workload
from test_pd_cluster_audit import assert_at_rest

from atom_core.pd.links import PrefillLinks
from atom_core.pd.transport import InProcessTransport


def _link() -> InProcessTransport:
    return InProcessTransport.pair()[0]


# --------------------------------------------------------------------------- readiness
def test_a_fast_restarted_prefill_worker_gets_no_retry_before_it_is_ready() -> None:
    """A prefill worker killed and started again before its decode workers polled the old
    link's loss (a supervisor restarting it at once): the old link's unanswered requests were
    retried with the new link in place, and the decode worker still held the rank as ready
    (the frontend's last list named it), so the retries went to the new process, still
    linking. They must go to the other prefill worker, and the new one serves once it reports
    ready."""
    c = cluster(prefill=2, decode=1, prefetch=2)
    cids = submit_workload(c, n=10)
    c.step()
    assert c.prefills[1].links.pending() > 0  # it holds requests when it dies
    c.kill("prefill", 1)
    c.start("prefill", 1, ready=False)  # in the same round: no step saw the loss
    c.run_until_done(rounds=3000)
    assert_exact(c, cids)
    assert c.prefills[1].worker.stats.requests == 0  # asked nothing while not ready
    assert c.decodes[0].links.retried > 0
    c.prefills[1].ready = True
    c.step()
    c.step()
    more = submit_workload(c, n=6, seed=4)
    c.run_until_done(rounds=3000)
    assert_exact(c, more)
    assert c.prefills[1].worker.stats.exports > 0
    assert_at_rest(c)


def test_a_stale_ready_list_does_not_make_a_new_process_ready() -> None:
    """A ready list sent before a prefill worker restarted can reach a decode worker after its
    link to the new process (links and control messages travel apart, across processes): the
    rank it names is the old process's. Lists name each ready worker's generation; a link to
    another generation waits for the list that names its own."""
    c = cluster(prefill=2, decode=1)
    old = c.prefills[1].gen
    c.kill("prefill", 1)
    c.start("prefill", 1, ready=False)
    c.step()
    # the old list, arriving late (as the frontend sent it before the restart)
    c.frontend.controls[("decode", 0)].send(
        {"kind": "prefill_ready", "ranks": [0, 1], "gens": [c.prefills[0].gen, old]})
    c.step()
    assert c.decodes[0].links.live() == [0]
    cids = submit_workload(c, n=6)
    c.run_until_done(rounds=3000)
    assert_exact(c, cids)
    assert c.prefills[1].worker.stats.requests == 0
    c.prefills[1].ready = True
    c.step()
    c.step()
    assert c.decodes[0].links.live() == [0, 1]
    # the frontend named the new process's generation, not the rank alone
    assert c.frontend.gens[("prefill", 1)] == c.prefills[1].gen != old
    assert c.decodes[0].links._ready_gen == {0: c.prefills[0].gen, 1: c.prefills[1].gen}
    assert_at_rest(c)


def test_ready_lists_and_links_match_by_generation_in_either_order() -> None:
    """The frontend's list may come before the decode worker has the link to that process
    (then it is used as soon as it is linked: no stall), or after (then it is used at once);
    a link to any other generation is not used; without generations a relinked rank waits for
    the next list naming it."""
    links = PrefillLinks(secure=False)
    links.add(0, _link(), gen=1)
    links.set_ready({0: 1})
    assert links.live() == [0]
    links.set_ready({0: 1, 1: 7})  # named ready before its link is here
    links.add(1, _link(), gen=7)
    assert links.live() == [0, 1]
    links.add(1, _link(), gen=8)  # restarted: the list named generation 7
    assert links.live() == [0]
    links.set_ready({0: 1, 1: 8})
    assert links.live() == [0, 1]
    # a frontend without generations: a relinked rank waits for the next list naming it
    links.set_ready([0, 1])
    links.add(0, _link())
    assert links.live() == [1]
    links.set_ready([0, 1])
    assert links.live() == [0, 1]


# --------------------------------------------------------------------------- found sound
class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_prefill_worker_killed_with_its_kv_in_flight_is_retried_once() -> None:
    """The KV a prefill worker sent is still on the wire when it dies (lost with it): the
    decode side's importing lanes keep their blocks, each request is asked again of the other
    prefill worker (same id and nonce) and served once, exactly; nothing is left anywhere."""
    c = cluster(prefill=2, decode=2)
    for link in c.prefills[0].links.links.values():
        link.inner.hold()  # what it sends stays in flight
    cids = submit_workload(c, n=8)
    for _ in range(6):
        c.step()
    assert c.prefills[0].worker.stats.exports > 0  # KV in flight when it dies
    c.kill("prefill", 0)
    c.run_until_done(rounds=3000)
    assert_exact(c, cids)
    assert sum(d.links.retried for d in c.decodes.values()) > 0
    assert c.frontend.late_events == 0
    assert all(d.worker.stale_messages == 0 for d in c.decodes.values())
    assert_at_rest(c)


def test_an_abort_during_a_transfer_that_never_ends_frees_its_blocks_at_the_timeout() -> None:
    """A client abort while its prefill worker hangs (holds every answer): the request ends at
    once as "aborted", its blocks drain; the transfer timeout frees them; the answer that comes
    after that is dropped, never written into blocks now someone else's."""
    clock = _Clock()
    c = cluster(prefill=1, decode=1, decode_options={"clock": clock, "transfer_timeout": 5.0})
    for link in c.prefills[0].links.links.values():
        link.inner.hold()
    a = c.submit(list(range(1, 90)), 8)
    for _ in range(6):
        c.step()
    d = c.decodes[0].worker
    assert d.batcher.transfers()  # its lane imports, asked and unanswered
    assert c.frontend.abort(a)
    for _ in range(3):
        c.step()
    assert c.frontend.results[a].error == "aborted"
    assert d.batcher.transfers()  # draining: its blocks wait for the transfer's end
    clock.t += 6.0
    c.step()
    assert d.batcher.transfers() == {}
    b = c.submit(list(range(3, 40)), 4)  # takes the freed blocks
    for link in c.prefills[0].links.links.values():
        link.inner.release()  # the hung answers arrive now: stale
    c.run_until_done(rounds=3000)
    assert_exact(c, [b])
    assert d.stale_messages > 0
    assert_at_rest(c)
