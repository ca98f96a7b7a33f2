"""Total at every edge, round three (issue 49).

- `AtomBatcher.import_kv` refuses KV holding NaN or inf where it would be written (host_kv,
  and local_kv on a hybrid model): that request fails alone with an error naming the field,
  nothing is written, no prefix-cache entry is filed and no block leaks; a later request
  sharing the prefix gets exactly the oracle's tokens. A value past the prompt that is never
  written (paged tables) is no reason to refuse.
- The frontend parses every report a worker sends totally (`parse_report`): a malformed one
  (Infinity, NaN, strings, bools, nested lists, missing fields, overlong lists, unknown kinds)
  never raises out of `Frontend.step`; it marks that worker faulty, whose requests end once
  (failed, as for a lost worker), while the other workers' requests finish exactly.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from test_cluster import assert_exact as assert_cluster_exact
from test_cluster import cluster
from test_pd_cluster_audit import assert_at_rest

from atom_core._generated import core
from atom_core.batcher import AtomBatcher, Event
from atom_core.pd import payload as pd
from atom_core.pd.cluster import MAX_EVENTS, LocalCluster, ReportError, parse_report
from atom_core.pd.router import Load
from tests import test_hybrid as hy
from tests.test_pd_batcher import (
    SYSTEM,
    C,
    Link,
    assert_exact,
    assert_no_block_leaked,
    batcher,
    config,
    inner,
    owners,
    prefill_side,
)
from tests.test_pd_paged import paged

_rng = random.Random(4949)

# NaN and both infinities, all over the prompt's positions or in one value
POISONS = [(float("nan"), "all"), (float("inf"), "one"), (float("-inf"), "one"),
           (float("nan"), "one")]


def _toks(n: int) -> list[int]:
    return [_rng.randrange(128) for _ in range(n)]


def _poison(t: torch.Tensor, value: float, where: str, n: int) -> torch.Tensor:
    """A copy of `t` with `value` in its first n positions (all of them, or one late in the
    prompt), or at position n (just past the prompt)."""
    bad = t.clone()
    if where == "all":
        bad[:, :, :, :n] = value
    elif where == "one":
        bad[-1, 1, 0, n - 1, -1] = value
    else:  # "past"
        bad[0, 0, 0, n, 0] = value
    return bad


def _cached_keys(b: AtomBatcher) -> list[Any]:
    d = core.describe_state(b.state)
    return [k for k, own in zip(d["key"], d["owner"], strict=True) if own == "CACHE"]


def _refused(d: AtomBatcher, rid: int, host: torch.Tensor, r: Any, field: str,
             local: Any = None) -> None:
    """import_kv of `host` fails rid alone, names `field`, writes nothing, frees its blocks."""
    blocks = d.describe()["lanes"][d.state.req_lane.get(rid)]["blocks"]
    updates = dict(inner(d.runtime).calls)
    events = d.import_kv(rid, r.prompt, r.first_token, host, local_kv=local)
    err = d.requests[rid].error
    assert events == [Event("error", rid, error=err)]
    assert err is not None and err.startswith(
        f"import rejected ({field}): {field} holds non-finite values (NaN or inf)"), err
    assert inner(d.runtime).calls == updates  # refused before anything was written
    assert d.requests[rid].ended and d.requests[rid].tokens == []
    assert rid not in d.transfers() and {owners(d)[b] for b in blocks} == {"FREE"}
    assert d.stats.transfer_failures == 1 and d.stats.imported_tokens == 0
    d.check_invariants()
    assert_no_block_leaked(d)


# --------------------------------------------------------------------------- import_kv
@pytest.mark.parametrize("value,where", POISONS + [(float("inf"), "past")],
                         ids=lambda v: str(v))
def test_non_finite_host_kv_fails_its_request_alone_and_is_never_cached(value: float,
                                                                        where: str) -> None:
    """One-block tables: the import buffer goes to the device as it is, so a value just past
    the prompt is written too and refused as well. A poisoned import used to decode as if the
    KV were zeros and leave a prefix-cache entry that a later request sharing the prefix hit."""
    d = batcher(config(2, prefix=True, extra=1))
    link = Link(prefill_side(), d)
    local = d.submit(_toks(30), 8)  # decoding beside the poisoned import: untouched
    bad = d.submit(SYSTEM + _toks(10), 5, remote=True)
    link.hold.add(bad)
    link.step_until(lambda: bad in link.ready)
    r = link.ready.pop(bad)
    link.hold.clear()
    _refused(d, bad, _poison(r.host, value, where, len(r.prompt)), r, "host_kv")
    link.run()
    assert_exact(link, [local])
    assert r.prompt not in _cached_keys(d)
    # a local request sharing the prefix computes it (nothing to hit) and is exact
    later = d.submit(SYSTEM + _toks(6), 4)
    link.run()
    assert_exact(link, [later])
    assert d.stats.prefix_hit_tokens == 0 and d.stats.transfer_failures == 1
    # the same prompt imported with good KV is cached and hit, exactly
    again = d.submit(r.prompt, 5, remote=True)
    link.run()
    hit = d.submit(SYSTEM + _toks(3), 4)
    link.run()
    assert_exact(link, [again, hit])
    assert d.stats.prefix_hit_tokens == 2 * C
    assert all(own in ("FREE", "CACHE", "SCRATCH") for own in owners(d))


@pytest.mark.parametrize("value,where", POISONS + [(float("nan"), "past")],
                         ids=lambda v: str(v))
def test_non_finite_host_kv_over_paged_tables(value: float, where: str) -> None:
    """Four blocks per table: an import's full blocks become cache entries, so a poisoned one
    would hand its KV to every later request sharing the prefix. Refused, nothing is cached;
    a value past the prompt is never written (blocks are written position by position) and
    the import goes through, exactly."""
    d = batcher(paged(2, 4, prefix=True))  # blocks of 64; SYSTEM spans two of them
    link = Link(batcher(paged(2, 4, True)), d, hold=[0])
    rid = d.submit(SYSTEM + _toks(5), 3, remote=True)
    link.step_until(lambda: rid in link.ready)
    r = link.ready.pop(rid)
    link.hold.clear()
    host = _poison(r.host, value, where, len(r.prompt))
    if where == "past":
        link._import(rid, type(r)(r.prompt, r.first_token, host))
        link.run()
        assert_exact(link, [rid])
        assert SYSTEM[:64] in _cached_keys(d)
        return
    _refused(d, rid, host, r, "host_kv")
    assert _cached_keys(d) == []
    local = d.submit(SYSTEM[:128] + _toks(40), 4)
    link.run()
    assert_exact(link, [local])
    assert d.stats.prefix_hit_tokens == 0 and d.stats.prefill_tokens == 168


@pytest.mark.parametrize("field", ["local_kv", "host_kv"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_non_finite_kv_of_a_hybrid_model_fails_its_request_alone(field: str,
                                                                 value: float) -> None:
    """A hybrid model's sliding window (local_kv) is written into the lane's local slot whole:
    a NaN or inf anywhere in it, or in the global KV, fails that request alone; the other
    import is exact and the batcher ends idle."""
    w = 16
    d = hy.batcher(hy.config(2, w))
    rng = random.Random(11)
    prompts = [hy.prompt_of(40, rng), hy.prompt_of(25, rng)]
    rids = [d.submit(pr, 7, remote=True) for pr in prompts]
    assert sorted(hy._importing(d, 2)) == rids
    (bad_p, bad_host), (good_p, good_host) = [hy._export_of(pr, w) for pr in prompts]
    assert bad_p.local_kv is not None
    local = bad_p.local_kv
    if field == "local_kv":
        local = local.clone()
        local[0, 1, 0, w - 1, 0] = value
    else:
        bad_host = _poison(bad_host, value, "one", len(bad_p.prompt))
    _refused(d, rids[0], bad_host, bad_p, field, local=local)
    assert d.import_kv(rids[1], good_p.prompt, good_p.first_token, good_host,
                       local_kv=good_p.local_kv)[0] == Event("token", rids[1],
                                                             token=good_p.first_token)
    while d.busy():
        hy.checked_step(d)
    hy.assert_exact(d, [rids[1]])
    hy.assert_idle(d)


def test_payload_validation_and_import_kv_share_one_finiteness_test() -> None:
    """pd.validate refuses what import_kv refuses, by the same predicate (one copy of the
    fact), integer tensors holding none."""
    from atom_core import batcher as batcher_module

    assert pd.all_finite is batcher_module.all_finite
    assert batcher_module.all_finite(torch.zeros(3, dtype=torch.int64))
    for v in (float("nan"), float("inf"), float("-inf")):
        assert not batcher_module.all_finite(torch.tensor([0.0, v], dtype=torch.bfloat16))


# --------------------------------------------------------------------------- the frontend
INF, NAN = float("inf"), float("nan")


def _row(cid: int, kind: str = "token", token: Any = 5, error: Any = None) -> list[Any]:
    return [cid, kind, token, error]


def _events(*rows: Any) -> dict[str, Any]:
    return {"kind": "events", "events": list(rows)}


def _load(c: LocalCluster, role: str, rank: int, **over: Any) -> dict[str, Any]:
    """A well-formed load report of that node, with fields replaced (or dropped: None)."""
    node = c.decodes[rank] if role == "decode" else c.prefills[rank]
    msg: dict[str, Any] = {"kind": "load", "load": Load(True, 0, 1, 1).as_json(),
                           "stats": {"exports": 0}, "gen": node.gen}
    if role == "decode":
        msg["unresponsive"] = []
    for k, v in over.items():
        if v is _DROP:
            del msg[k]
        else:
            msg[k] = v
    return msg


_DROP = object()

# (what, report) for decode node 1; a report is built from its cluster and an open request of
# it. Each is malformed in one field.
DECODE_BAD: list[tuple[str, Any]] = [
    ("token Infinity", lambda c, cid: _events(_row(cid, token=INF))),
    ("token -Infinity", lambda c, cid: _events(_row(cid, token=-INF))),
    ("token NaN", lambda c, cid: _events(_row(cid, token=NAN))),
    ("token string", lambda c, cid: _events(_row(cid, token="5"))),
    ("token bool", lambda c, cid: _events(_row(cid, token=True))),
    ("token float", lambda c, cid: _events(_row(cid, token=5.0))),
    ("token past the vocabulary", lambda c, cid: _events(_row(cid, token=c.frontend.vocab_size))),
    ("token negative", lambda c, cid: _events(_row(cid, token=-1))),
    ("token nested", lambda c, cid: _events(_row(cid, token=[[5]]))),
    ("token missing", lambda c, cid: _events(_row(cid, token=None))),
    ("token on an end", lambda c, cid: _events(_row(cid, "finished", token=5))),
    ("cid string", lambda c, cid: _events(_row(str(cid)))),
    ("cid bool", lambda c, cid: _events(_row(True))),
    ("cid Infinity", lambda c, cid: _events(_row(INF))),
    ("cid never issued", lambda c, cid: _events(_row(10 ** 6))),
    ("cid nested", lambda c, cid: _events(_row([cid]))),
    ("kind unknown", lambda c, cid: _events(_row(cid, "tokens"))),
    ("kind nested", lambda c, cid: _events(_row(cid, ["token"]))),
    ("error not a string", lambda c, cid: _events(_row(cid, "error", None, 7))),
    ("error missing", lambda c, cid: _events(_row(cid, "error", None, None))),
    ("error on a token", lambda c, cid: _events(_row(cid, error="x"))),
    ("row short", lambda c, cid: _events([cid, "token", 5])),
    ("row long", lambda c, cid: _events([cid, "token", 5, None, None])),
    ("row an object", lambda c, cid: _events({"cid": cid})),
    ("rows nested", lambda c, cid: _events([[[[[]]]]])),
    ("a bad row after good ones", lambda c, cid: _events(_row(cid), _row(cid, token=INF))),
    ("events overlong", lambda c, cid: _events(*[_row(cid, "preempted", None)] * (MAX_EVENTS + 1))),
    ("events a string", lambda c, cid: {"kind": "events", "events": "[]"}),
    ("events missing", lambda c, cid: {"kind": "events"}),
    ("load missing", lambda c, cid: _load(c, "decode", 1, load=_DROP)),
    ("load Infinity", lambda c, cid: _load(c, "decode", 1, load={
        **Load(True, 0, 1, 1).as_json(), "queued": INF})),
    ("load ready string", lambda c, cid: _load(c, "decode", 1, load={
        **Load(True, 0, 1, 1).as_json(), "ready": "yes"})),
    ("stats missing", lambda c, cid: _load(c, "decode", 1, stats=_DROP)),
    ("stats Infinity", lambda c, cid: _load(c, "decode", 1, stats={"exports": INF})),
    ("stats NaN", lambda c, cid: _load(c, "decode", 1, stats={"exports": NAN})),
    ("stats nested", lambda c, cid: _load(c, "decode", 1, stats={"exports": {"a": 1}})),
    ("stats bool", lambda c, cid: _load(c, "decode", 1, stats={"exports": False})),
    ("stats a list", lambda c, cid: _load(c, "decode", 1, stats=[1])),
    ("stats overlong", lambda c, cid: _load(c, "decode", 1,
                                             stats={str(i): 0 for i in range(1000)})),
    ("gen Infinity", lambda c, cid: _load(c, "decode", 1, gen=INF)),
    ("gen string", lambda c, cid: _load(c, "decode", 1, gen="1")),
    ("gen bool", lambda c, cid: _load(c, "decode", 1, gen=True)),
    ("unresponsive overlong", lambda c, cid: _load(c, "decode", 1,
                                                   unresponsive=[[0, 1]] * 5000)),
    ("unresponsive Infinity", lambda c, cid: _load(c, "decode", 1, unresponsive=[[0, INF]])),
    ("kind not a report", lambda c, cid: {"kind": "status"}),
    ("kind missing", lambda c, cid: {"events": [_row(cid)]}),
    ("kind nested", lambda c, cid: {"kind": ["events"], "events": []}),
]


def _two_decode_cluster() -> tuple[LocalCluster, list[int], list[int]]:
    """Two prefill and two decode workers, requests on both decode workers, some of decode
    worker 1's still open: (cluster, every request, decode worker 1's open ones)."""
    c = cluster(prefill=2, decode=2)
    cids = [c.submit(p, 12) for p in (_toks(40), _toks(90), _toks(20), _toks(70),
                                      _toks(33), _toks(50))]
    for _ in range(3):
        c.step()
    fe = c.frontend
    open_1 = [x for x in cids if fe.results[x].decode == 1 and not fe.results[x].ended]
    assert open_1 and any(fe.results[x].decode == 0 for x in cids)
    return c, cids, open_1


def _send(c: LocalCluster, role: str, rank: int, header: Any) -> None:
    """`header` from that worker to the frontend. One its link refuses to send (a kind that is
    not a string: a secure link's receiver never delivers one either, a plain transport's does)
    is put straight into the frontend's next poll of that link."""
    node = c.decodes[rank] if role == "decode" else c.prefills[rank]
    try:
        node.control.send(header)
    except (TypeError, ValueError):
        link = c.frontend.controls[(role, rank)]
        poll = link.poll

        def once() -> list[Any]:
            link.poll = poll  # type: ignore[method-assign]
            return [(header, None), *poll()]

        link.poll = once  # type: ignore[method-assign]


def _ends_once(c: LocalCluster) -> None:
    fe = c.frontend
    assert len(fe._ended) == len(set(fe._ended)) and not fe.busy()
    assert all(r.ended for r in fe.results.values())


@pytest.mark.parametrize("what,bad", DECODE_BAD, ids=[w for w, _ in DECODE_BAD])
def test_a_malformed_decode_report_makes_that_worker_faulty_and_the_rest_goes_on(
        what: str, bad: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Decode worker 1 sends one malformed report: `Frontend.step` does not raise (a token
    `Infinity` raised OverflowError out of it), nothing of the report is taken, the worker is
    taken for faulty (lost: not chosen, its control link closed, told to stop), its open
    requests fail once with an error saying why, every other request is exact, and new
    requests are served by the others, exactly; nothing is left behind."""
    c, cids, open_1 = _two_decode_cluster()
    fe = c.frontend
    tokens_before = {x: list(fe.results[x].tokens) for x in cids}
    _send(c, "decode", 1, bad(c, open_1[0]))
    with caplog.at_level("WARNING", logger="atom_core.pd.cluster"):
        fe.step()
    assert [r.getMessage() for r in caplog.records if "faulty" in r.getMessage()] == [
        f"frontend: decode worker 1 sent a malformed report, taken for faulty and stopped: "
        f"{fe.faulty[('decode', 1)]}"]
    assert ("decode", 1) not in fe.controls and 1 in fe.router.lost["decode"]
    assert fe.router.ready("decode") == [0]
    for x in open_1:
        r = fe.results[x]
        assert r.ended and r.tokens == tokens_before[x]  # the bad report took nothing
        assert "decode worker 1 was lost (taken for faulty" in (r.error or ""), r.error
    c.run_until_done(rounds=3000)
    assert c.decodes[1].done  # it heard it and stopped: its links are closed
    _ends_once(c)
    assert_cluster_exact(c, [x for x in cids if x not in open_1])
    more = [c.submit(_toks(30), 5) for _ in range(3)]
    c.run_until_done(rounds=3000)
    assert_cluster_exact(c, more)
    assert {fe.results[x].decode for x in more} == {0}
    assert_at_rest(c)


PREFILL_BAD: list[tuple[str, Any]] = [
    ("load Infinity", lambda c: _load(c, "prefill", 1, load={
        **Load(True, 0, 1, 1).as_json(), "free_blocks": INF})),
    ("stats NaN", lambda c: _load(c, "prefill", 1, stats={"refused_busy": NAN})),
    ("gen string", lambda c: _load(c, "prefill", 1, gen="x")),
    ("events from a prefill worker", lambda c: _events(_row(0))),
    ("kind unknown", lambda c: {"kind": "kv"}),
]


@pytest.mark.parametrize("what,bad", PREFILL_BAD, ids=[w for w, _ in PREFILL_BAD])
def test_a_malformed_prefill_report_moves_its_requests_to_the_others(what: str,
                                                                     bad: Any) -> None:
    """Prefill worker 1 sends a malformed report with requests on it: it is taken for faulty
    and stops; its decode workers ask the other prefill worker again (same ids and nonces), so
    every request ends once, exactly."""
    c = cluster(prefill=2, decode=2)
    cids = [c.submit(p, 6) for p in (_toks(40), _toks(90), _toks(20), _toks(70))]
    c.step()
    fe = c.frontend
    assert 1 in {fe.results[x].prefill for x in cids}
    _send(c, "prefill", 1, bad(c))
    fe.step()
    assert ("prefill", 1) in fe.faulty and 1 in fe.router.lost["prefill"]
    assert fe.router.usable("prefill") == [0]
    c.run_until_done(rounds=3000)
    assert c.prefills[1].done
    _ends_once(c)
    assert_cluster_exact(c, cids)
    assert_at_rest(c)


def test_a_well_formed_report_parses_to_its_record_and_anything_else_is_a_report_error(
        ) -> None:
    """`parse_report` alone: the nodes' own messages parse, with the vocabulary and the ids
    issued as bounds; whatever else it is given, it raises ReportError and nothing else."""
    ok = parse_report("decode", _events(_row(3, token=127), _row(3, "preempted", None),
                                        _row(3, "error", None, "x"),
                                        _row(2, "finished", None)),
                      vocab_size=128, issued=4)
    assert [(e.cid, e.kind, e.token, e.error) for e in ok.events] == [  # type: ignore[union-attr]
        (3, "token", 127, None), (3, "preempted", None, None), (3, "error", None, "x"),
        (2, "finished", None, None)]
    assert parse_report("decode", {"kind": "peer_lost", "error": "gone"}).why == "gone"  # type: ignore[union-attr]
    for header, kw in [(_events(_row(3, token=128)), {"vocab_size": 128}),
                       (_events(_row(4)), {"issued": 4}),
                       (_events(_row(0, token=2 ** 31)), {}),
                       ([], {}), (None, {}), ("load", {}), (b"x", {}),
                       ({"kind": "load", "load": None}, {}),
                       ({"kind": "load", "load": {**Load().as_json(), "x": 1}, "stats": {}},
                        {}),
                       ({"kind": "load", "load": Load().as_json(), "stats": {1: 2}}, {}),
                       ({"kind": "load", "load": Load().as_json(), "stats": {},
                         "gen": 10 ** 30}, {})]:
        with pytest.raises(ReportError):
            parse_report("decode", header, **kw)
    # a prefill worker's report names no hung workers: a field it does not have is not read
    rep = parse_report("prefill", {"kind": "load", "load": Load().as_json(), "stats": {},
                                   "unresponsive": "anything"})
    assert rep.hung is None  # type: ignore[union-attr]
