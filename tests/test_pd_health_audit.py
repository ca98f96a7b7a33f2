"""Slow, hung and unreachable peers in PD (`LocalCluster`: real workers, links and crypto; the
CLI in-process): a retried prefill request gets its own deadline; a prefill worker that lets a
request time out is asked nothing until it shows it is alive, and what it held is served
elsewhere, exactly, with nothing left behind; a --host that does not resolve is a usage error
before anything waits."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping

import pytest
from test_cluster import assert_exact, cluster, submit_workload
from test_pd_cluster_audit import assert_at_rest

from atom_core import cli
from atom_core.pd.cluster import STATS_EVERY, LocalCluster
from atom_core.pd.router import Load

DEADLINE = 5.0


class _Clock:
    """The decode workers' clock (transfer deadlines): moved by the test alone."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _timed(prefill: int, **kw: object) -> tuple[LocalCluster, _Clock]:
    clock = _Clock()
    c = cluster(prefill=prefill, decode=1,
                decode_options={"clock": clock, "transfer_timeout": DEADLINE}, **kw)
    return c, clock


def _hold_answers(c: LocalCluster, rank: int) -> None:
    """What prefill worker `rank` sends its decode workers (answers, pongs) stays in flight
    until `_release_answers`: a slow worker, or a hung one's answers once it runs again."""
    for link in c.prefills[rank].links.links.values():
        link.inner.hold()


def _release_answers(c: LocalCluster, rank: int) -> None:
    for link in c.prefills[rank].links.links.values():
        link.inner.release()


def _steps(c: LocalCluster, n: int) -> None:
    for _ in range(n):
        c.step()


def _asked_of(c: LocalCluster, rank: int) -> list[int]:
    return [p for p in c.decodes[0].links._where.values() if p == rank]


class _Lowest:
    """A policy that always picks the lowest ready worker (the hung one, in these tests)."""

    def choose(self, candidates: Mapping[int, Load], holders: Mapping[int, int]) -> int:
        return min(candidates)


def _step_without(c: LocalCluster, hung: int, n: int = 1) -> None:
    """`n` rounds in which prefill worker `hung` does not run at all (its process is stuck:
    its links stay up, it reads nothing, answers nothing, reports nothing)."""
    for _ in range(n):
        for node in [*c.decodes.values(), *c.prefills.values()]:
            if not node.done and node is not c.prefills[hung]:
                node.step()
        c.frontend.step()


def _run_without(c: LocalCluster, hung: int, rounds: int = 3000) -> None:
    for _ in range(rounds):
        if not c.frontend.busy():
            return
        _step_without(c, hung)
    raise AssertionError(f"requests still running: {sorted(c.frontend._open)}")


def _reported(c: LocalCluster, rounds: Callable[[], None]) -> dict[str, int]:
    """The decode node's stats as the frontend has them after `rounds`, run once a report of
    counters alone is due again (STATS_EVERY)."""
    time.sleep(STATS_EVERY)
    rounds()
    return c.frontend.worker_stats[("decode", 0)]


# --------------------------------------------------------------------------- 1: deadlines
def _served_within_its_retry_deadline(c: LocalCluster, clock: _Clock, retried: int,
                                      cids: list[int]) -> None:
    """Past `retried`'s first attempt's deadline, well within its retry's: it does not time
    out; the slow prefill worker 1 answers, and every request is served exactly, with no
    timeout anywhere."""
    clock.t += 2.0
    _steps(c, 3)
    assert not c.frontend.results[retried].ended, c.frontend.results[retried].error
    _release_answers(c, 1)
    c.run_until_done(rounds=2000)
    assert_exact(c, cids)
    d = c.decodes[0]
    assert not any(r.kind == "timeout" for r in d.worker.requests.values())
    assert d.resubmitted == 0 and d.links.timeouts == 0
    assert_at_rest(c)


def test_a_request_retried_after_a_loss_gets_a_deadline_of_its_own() -> None:
    """Its prefill worker dies late in the first attempt's time; the request is asked again of
    another one: the retry has the whole deadline. It used to keep the first attempt's clock
    (the decode worker never heard of the retry) and time out almost at once."""
    c, clock = _timed(2)
    _hold_answers(c, 0)
    _hold_answers(c, 1)  # slow: it answers only when the test says so
    cid = c.submit(list(range(1, 60)), 4)
    _steps(c, 4)
    assert _asked_of(c, 0)  # the router's choice holds it
    clock.t += DEADLINE - 1
    c.kill("prefill", 0)
    _steps(c, 2)
    assert c.decodes[0].links.retried == 1 and _asked_of(c, 1)
    _served_within_its_retry_deadline(c, clock, cid, [cid])


def test_a_request_retried_after_a_busy_refusal_gets_a_deadline_of_its_own() -> None:
    """The same for a refusal for backpressure that comes late (the prefill worker was slow to
    read it, then full): the request asked of the next worker has the whole deadline."""
    c, clock = _timed(2, policy=_Lowest(), prefill_options={"max_queued": 1})
    _hold_answers(c, 1)
    x = c.submit(list(range(1, 60)), 4)
    y = c.submit(list(range(7, 80)), 4)
    _step_without(c, 0, 4)
    assert len(_asked_of(c, 0)) == 2  # unread by prefill worker 0
    clock.t += DEADLINE - 1
    _steps(c, 3)  # it reads both: takes x, refuses y (full); y is asked of worker 1
    assert c.prefills[0].worker.stats.refused_busy == 1
    assert c.decodes[0].links.busy_retried == 1 and _asked_of(c, 1)
    _served_within_its_retry_deadline(c, clock, y, [x, y])


def test_a_retry_still_times_out_after_its_own_deadline() -> None:
    """Per attempt, not never: a retry that gets no answer for a whole deadline times out
    (and, its worker taken for hung, is served locally)."""
    c, clock = _timed(2)
    _hold_answers(c, 0)
    _hold_answers(c, 1)
    cid = c.submit(list(range(1, 60)), 4)
    _steps(c, 4)
    clock.t += DEADLINE - 1
    c.kill("prefill", 0)
    _steps(c, 2)
    clock.t += DEADLINE + 0.5
    _steps(c, 2)
    d = c.decodes[0]
    assert d.links.timeouts == 1 and d.links.unresponsive.keys() == {1}
    c.run_until_done(rounds=2000)
    assert_exact(c, [cid])
    _release_answers(c, 1)
    _steps(c, 3)
    assert_at_rest(c)


# --------------------------------------------------------------------------- 2: hung workers
def test_a_hung_prefill_worker_is_avoided_until_it_answers_again(
        caplog: pytest.LogCaptureFixture) -> None:
    """A prefill worker whose process hangs (links up, nothing answered): once a request times
    out on it, it is asked nothing more, and the router chooses it no more (the decode node
    reports it: tests/test_pd_router_health_audit.py); what it held is served elsewhere,
    exactly, none failed; the log and the decode node's stats say so. Once it runs again (it
    answers the ping) it is asked again; nothing is left behind, on either side."""
    c, clock = _timed(2, policy=_Lowest(), prefetch=2)
    first = submit_workload(c, n=6)
    with caplog.at_level(logging.WARNING, logger="atom_core.pd.links"):
        _step_without(c, 0, 6)
        assert _asked_of(c, 0)
        clock.t += DEADLINE + 0.5
        _step_without(c, 0, 2)
    d = c.decodes[0]
    asked = d.links.timeouts + d.links.retried  # all it was asked: timed out, or moved
    assert d.links.unresponsive.keys() == {0} and d.links.live() == [1]
    assert "prefill worker 0 is not answering" in caplog.text
    more = submit_workload(c, n=6, seed=5)
    _run_without(c, 0)
    assert_exact(c, first + more)  # none failed for the hang
    assert all(c.frontend.results[x].prefill == 1 for x in more)  # set aside by the router
    assert d.links.timeouts >= 1 and d.timeout_resubmitted >= 1
    stats = _reported(c, lambda: _step_without(c, 0, 2))
    assert stats["prefill_timeouts"] >= 1 and stats["unresponsive_prefill"] == 1
    with caplog.at_level(logging.WARNING, logger="atom_core.pd.links"):
        _steps(c, 6)  # it runs again: reads what waited (cancels, the ping), answers
    assert c.prefills[0].worker.stats.requests == asked  # nothing more was sent to it
    assert d.links.unresponsive == {} and d.links.live() == [0, 1]
    assert "prefill worker 0 answers again" in caplog.text
    assert _reported(c, lambda: _steps(c, 2))["unresponsive_prefill"] == 0
    exports = c.prefills[0].worker.stats.exports
    again = submit_workload(c, n=8, seed=7)
    c.run_until_done(rounds=3000)
    assert_exact(c, again)
    assert c.prefills[0].worker.stats.exports > exports  # used again
    assert_at_rest(c)


def test_a_woken_workers_answer_does_not_end_a_request_moved_elsewhere() -> None:
    """A request taken from a hung prefill worker and asked of another one, still in flight
    there when the hung one wakes: the woken one's answer (its refusal of the cancel it was
    sent) is dropped; the request ends once, with the other worker's KV."""
    c, clock = _timed(2, policy=_Lowest())
    a = c.submit(list(range(1, 60)), 4)
    _step_without(c, 0, 4)
    clock.t += 3.0
    b = c.submit(list(range(5, 70)), 4)  # asked of the hung worker later: not timed out yet
    _step_without(c, 0, 4)
    assert len(_asked_of(c, 0)) == 2
    _hold_answers(c, 1)  # the other worker is slow: what it is asked stays in flight
    clock.t += DEADLINE - 2.5  # a's deadline passes, not b's
    _step_without(c, 0, 2)
    d = c.decodes[0]
    assert d.links.unresponsive.keys() == {0} and d.links.retried == 1  # b moved
    assert not c.frontend.results[b].ended
    _steps(c, 6)  # the hung worker runs again: takes a and b, then b's cancel: refuses it
    assert c.prefills[0].worker.stats.cancelled >= 1 and d.links.superseded >= 1
    assert not c.frontend.results[b].ended, c.frontend.results[b].error
    _release_answers(c, 1)
    c.run_until_done(rounds=2000)
    assert_exact(c, [a, b])
    assert_at_rest(c)


def test_a_lone_hung_prefill_worker_sends_everything_to_local_prefill() -> None:
    """The only prefill worker hangs: its requests (those holding a lane and those waiting)
    are prefilled locally, exactly; blocks and routing entries are all freed; once it runs
    again, it is asked again."""
    c, clock = _timed(1, prefetch=2)
    first = submit_workload(c, n=6)
    _step_without(c, 0, 6)
    clock.t += DEADLINE + 0.5
    _run_without(c, 0)
    assert_exact(c, first)
    d = c.decodes[0]
    assert d.links.unresponsive.keys() == {0} and d.worker.lost is not None
    assert d.worker.batcher.stats.prefill_tokens > 0  # served here
    _steps(c, 6)
    assert d.links.live() == [0] and d.worker.lost is None
    before = c.prefills[0].worker.stats.exports
    again = submit_workload(c, n=4, seed=2)
    c.run_until_done(rounds=3000)
    assert_exact(c, again)
    assert c.prefills[0].worker.stats.exports > before
    assert_at_rest(c)


def test_a_restarted_hung_prefill_worker_is_a_new_process_not_a_hung_one() -> None:
    """The hang ends with a restart (a supervisor's): the new process's link clears the mark;
    it is asked once the frontend names it ready."""
    c, clock = _timed(2, policy=_Lowest())
    first = submit_workload(c, n=4)
    _step_without(c, 0, 6)
    clock.t += DEADLINE + 0.5
    _run_without(c, 0)
    assert_exact(c, first)
    assert c.decodes[0].links.unresponsive.keys() == {0}
    c.kill("prefill", 0)
    c.start("prefill", 0)
    _steps(c, 3)
    assert c.decodes[0].links.unresponsive == {} and c.decodes[0].links.live() == [0, 1]
    more = submit_workload(c, n=6, seed=9)
    c.run_until_done(rounds=3000)
    assert_exact(c, more)
    assert c.prefills[0].worker.stats.exports > 0
    assert_at_rest(c)


# --------------------------------------------------------------------------- 3: --host
@pytest.mark.parametrize("argv", [
    ["pd-prefill"],
    ["pd-decode"],
    ["pd-cluster"],
    ["pd-cluster", "--rank", "0", "--port", "29999"],
    ["pd-cluster", "--rank", "1", "--port", "29999"],
])
def test_a_host_that_does_not_resolve_is_a_usage_error_before_any_wait(
        capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """One line naming the host, exit 2 (a usage error, as for every bad option), before the
    "waiting"/"connecting" line; it used to print that line, then fail later with exit 1 (or,
    for the launcher, a traceback)."""
    bad = ["--host", "nonexistent.invalid", "--insecure", "--timeout", "5"]
    assert cli.main([*argv, *bad]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--host 'nonexistent.invalid' does not resolve" in lines[0], err
    assert cli.main([*argv, *bad, "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and "does not resolve" in out["error"]


def test_the_wildcard_host_is_a_usage_error_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["pd-prefill", "--host", "0.0.0.0", "--insecure"]) == 2
    err = capsys.readouterr().err
    assert "wildcard address" in err and "Traceback" not in err
