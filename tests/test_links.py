"""The per-peer link sets a cluster's workers run over (atom_core/pd/links.py), message by message
over in-process pairs: routing, re-asking after a loss, cancels, and what a lost peer leaves."""

from __future__ import annotations

import pytest

from atom_core.pd.links import DecodeLinks, PrefillLinks
from atom_core.pd.transport import PEER_LOST, InProcessTransport, TransportError

N1, N2 = "1" * 32, "2" * 32


def prefill_side(n: int) -> tuple[PrefillLinks, dict[int, InProcessTransport]]:
    """A decode worker's PrefillLinks to `n` prefill workers; their ends by worker."""
    links = PrefillLinks(secure=False)
    peers = {}
    for p in range(n):
        mine, theirs = InProcessTransport.pair()
        links.add(p, mine)
        peers[p] = theirs
    return links, peers


def kinds(msgs: list) -> list:
    return [(h["kind"], h.get("id", h.get("request_id"))) for h, _ in msgs]


def test_prefill_requests_go_where_routed_else_to_the_least_busy() -> None:
    links, peers = prefill_side(3)
    links.route("a", 2)
    links.send({"kind": "prefill", "id": "a", "nonce": N1, "prompt": [1]})
    links.send({"kind": "prefill", "id": "b", "nonce": N2, "prompt": [2]})  # unrouted
    links.send({"kind": "prefill", "id": "c", "nonce": N2, "prompt": [3]})
    assert kinds(peers[2].poll()) == [("prefill", "a")]
    assert kinds(peers[0].poll()) == [("prefill", "b")]
    assert kinds(peers[1].poll()) == [("prefill", "c")]
    # a cancel follows its request
    links.send({"kind": "cancel", "id": "c", "nonce": N2})
    assert kinds(peers[1].poll()) == [("cancel", "c")]
    assert links.busy()
    peers[2].send({"kind": "kv", "request_id": "a", "nonce": N1})
    assert kinds(links.poll()) == [("kv", "a")]
    with pytest.raises(ValueError, match="prefill, cancel or shutdown"):
        links.send({"kind": "kv"})


def test_a_lost_prefill_worker_has_its_requests_asked_again_elsewhere() -> None:
    links, peers = prefill_side(2)
    links.route("a", 0)
    links.route("b", 0)
    links.send({"kind": "prefill", "id": "a", "nonce": N1, "prompt": [1]})
    links.send({"kind": "prefill", "id": "b", "nonce": N2, "prompt": [2]})
    links.send({"kind": "cancel", "id": "b", "nonce": N2})
    peers[0].kill()
    got = links.poll()
    # the cancelled one ends here (its draining block is freed); the other is asked again
    assert [(h["kind"], h["id"], h["nonce"]) for h, _ in got] == [("prefill_failed", "b", N2)]
    assert [(h["kind"], h["id"], h["nonce"]) for h, _ in peers[1].poll()] == [
        ("prefill", "a", N1)]
    assert links.retried == 1 and links.live() == [1] and 0 in links.lost
    # the last one lost: the worker hears of it, once
    peers[1].kill()
    got = links.poll()
    assert [h["kind"] for h, _ in got] == [PEER_LOST] and "every prefill worker" in \
        got[0][0]["error"]
    assert links.poll() == [] and not links.busy()
    with pytest.raises(TransportError, match="no prefill worker is alive"):
        links.send({"kind": "prefill", "id": "c", "nonce": N1, "prompt": [1]})
    # one (re)joins: used again
    mine, theirs = InProcessTransport.pair()
    links.add(5, mine)
    links.send({"kind": "prefill", "id": "c", "nonce": N1, "prompt": [1]})
    assert kinds(theirs.poll()) == [("prefill", "c")]


def test_decode_links_answer_the_asker_and_refuse_foreign_ids() -> None:
    links = DecodeLinks(secure=False)
    ends = {}
    for d in (0, 1):
        mine, theirs = InProcessTransport.pair()
        links.add(d, mine)
        ends[d] = theirs
    ends[0].send({"kind": "prefill", "id": "d0.1", "nonce": N1, "prompt": [1]})
    ends[1].send({"kind": "prefill", "id": "d1.1", "nonce": N2, "prompt": [1]})
    ends[1].send({"kind": "prefill", "id": "d0.1", "nonce": N2, "prompt": [1]})  # in use
    ends[1].send({"kind": "cancel", "id": "d0.1", "nonce": N1})  # not its own
    assert kinds(links.poll()) == [("prefill", "d0.1"), ("prefill", "d1.1")]
    assert links.refused == 2 and links.pending() == 2
    links.send({"kind": "kv", "request_id": "d1.1", "nonce": N2})
    links.send({"kind": "prefill_failed", "id": "d0.1", "nonce": N1})
    assert kinds(ends[1].poll()) == [("kv", "d1.1")]
    assert kinds(ends[0].poll()) == [("prefill_failed", "d0.1")]
    assert links.pending() == 0
    with pytest.raises(ValueError, match="kv or prefill_failed"):
        links.send({"kind": "prefill"})


def test_a_lost_decode_worker_has_its_requests_cancelled_and_nothing_else() -> None:
    links = DecodeLinks(secure=False)
    ends = {}
    for d in (0, 1):
        mine, theirs = InProcessTransport.pair()
        links.add(d, mine)
        ends[d] = theirs
    ends[0].send({"kind": "prefill", "id": "x", "nonce": N1, "prompt": [1]})
    ends[1].send({"kind": "prefill", "id": "y", "nonce": N2, "prompt": [1]})
    links.poll()
    ends[0].kill()
    got = links.poll()
    assert [(h["kind"], h["id"], h["nonce"]) for h, _ in got] == [("cancel", "x", N1)]
    assert links.alive  # the worker keeps serving the others
    links.send({"kind": "prefill_failed", "id": "x", "nonce": N1})  # its answer: dropped
    assert links.dropped_answers == 1
    links.send({"kind": "kv", "request_id": "y", "nonce": N2})
    assert kinds(ends[1].poll()) == [("kv", "y")]
    # a shutdown from a decode worker is the same: it is done with this prefill worker
    ends[1].send({"kind": "shutdown"})
    assert links.poll() == [] and links.links == {} and links.alive
