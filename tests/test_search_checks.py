"""The stuck-run checkers' own negative tests: `search.confirm` (z3 replays a run against the
spec) rejects runs that are not stuck runs, and a breadth-first search the depth cap cut off
is never a "safe" verdict. Each rejection is checked against the generated core as an oracle,
so a confirm that answered True (or False) blindly fails here."""

from __future__ import annotations

from typing import Any

import pytest

from atom_core._generated import core as g
from atom_core.proofs import capacity, run, search, witness
from atom_core.replay import _args
from atom_core.spec.model import MODEL

TIGHT, _SINGLE = witness.committed()
# A prefix-cache run with two requests, prefills, decodes and a grow (paged tables): its
# prompts matter (their lengths decide the prefill chunks and when a table fills).
ROW = ("prefix cache, reserved scratch, T=2", 2)
W = TIGHT[ROW]
Raw = list[tuple[str, dict[str, Any]]]


pytestmark = pytest.mark.usefixtures("fresh_z3")


def consts() -> Any:
    return g.Consts(**{k: W.consts[k] for k in witness.CONSTS})


def core_accepts(raw: Raw) -> bool:
    """The generated core's verdict: every step accepted and the final state breaks the
    witness's property."""
    c = consts()
    s = g.init(c, ghost=True)
    for name, args in raw:
        step = g.ACTIONS[name][0](s, **_args(name, args, c))
        if step.rejected is not None:
            return False
        s = step.state
    return W.violated in g.progress_violations(s)


def confirms(raw: Raw) -> bool:
    c = consts()
    return search.confirm(MODEL, c, [(n, _args(n, a, c)) for n, a in raw], W.violated,
                          W.requests)


def test_the_committed_run_is_confirmed():
    raw = list(W.run)
    assert len(raw) >= 4 and core_accepts(raw)
    assert confirms(raw) is True


def test_a_truncated_run_is_rejected():
    """A shortest stuck run: no proper prefix of it ends stuck."""
    raw = list(W.run)
    for n in (len(raw) - 1, len(raw) // 2):
        assert not core_accepts(raw[:n]), n
        assert confirms(raw[:n]) is False, n


def test_a_run_with_a_refused_step_is_rejected():
    """Each step taken twice in a row: the core refuses the repeat (its guard no longer
    holds), and so must z3."""
    raw = list(W.run)
    tried = 0
    for i, step in enumerate(raw):
        bad = raw[:i + 1] + [step] + raw[i + 1:]
        c = consts()
        s = g.init(c, ghost=True)
        for name, args in raw[:i + 1]:
            s = g.ACTIONS[name][0](s, **_args(name, args, c)).state
        if g.ACTIONS[step[0]][0](s, **_args(step[0], step[1], c)).rejected is None:
            continue  # (a repeat the spec allows is no refused step)
        tried += 1
        assert confirms(bad) is False, (i, step)
    assert tried >= 3


def _prompt_variants(p: list[int]) -> list[list[int]]:
    out = [p + [p[-1] + 1], [t + 1 for t in p]]
    if len(p) > 1:
        out.append(p[:-1])
    return out


def test_a_run_with_a_changed_prompt_agrees_with_the_core():
    """Every submitted prompt changed in turn (a token more, fewer, others): z3 confirms the
    changed run exactly when the core accepts it, and at least one change breaks the run."""
    raw = list(W.run)
    rejected = accepted = 0
    for i, (name, args) in enumerate(raw):
        if name != "submit":
            continue
        for p in _prompt_variants(list(args["p"])):
            changed = raw[:i] + [(name, {**args, "p": p})] + raw[i + 1:]
            want = core_accepts(changed)
            assert confirms(changed) is want, (i, p)
            rejected += not want
            accepted += want
    assert rejected >= 1


# --------------------------------------------------------------------------- the depth cap
SAFE = next(c for c in capacity.SINGLE_BLOCK if c.name == "colocated-one-lane-safe")


def capped(monkeypatch: pytest.MonkeyPatch, depth: int) -> None:
    orig = search.shortest_stuck_run
    monkeypatch.setattr(search, "shortest_stuck_run",
                        lambda *a, **k: orig(*a, **{**k, "max_depth": depth}))


def test_an_exhaustive_search_is_a_safe_verdict():
    tr, w = run.t_single(MODEL, SAFE, None)
    assert tr is None and w is None
    assert run.single_check(SAFE, tr, "searched").status == "proved"


def test_a_search_cut_off_by_its_depth_cap_is_no_safe_verdict(monkeypatch):
    c = g.Consts(B=SAFE.lanes, K=1, C=search.TRACE_CHUNK, S=search.TRACE_SEQ_LEN, T=1,
                 PREFIX=SAFE.prefix_cache, RESERVED=False, SCRATCH=0, HYBRID=False,
                 HOST=False, H=0, PREEMPT=False)
    assert search.shortest_stuck_run(c, role=SAFE.role) is None  # exhaustive at the default
    with pytest.raises(search.SearchCutOff, match="depth cap"):
        search.shortest_stuck_run(c, role=SAFE.role, max_depth=2)
    capped(monkeypatch, 2)
    tr, _w = run.t_single(MODEL, SAFE, None)
    assert isinstance(tr, str) and run.CUT_OFF in tr
    check = run.single_check(SAFE, tr, "searched")
    assert check.status == "counterexample" and "depth cap" in check.detail


def test_a_stuck_run_beyond_the_cap_is_reported_not_missed(monkeypatch):
    """The committed run needs len(W.run) steps: a search capped below finds none, and must
    say it was cut off rather than that there is none."""
    f = next(f for f in capacity.COMBINATIONS if f.name == ROW[0])
    capped(monkeypatch, len(W.run) - 2)
    with pytest.raises(search.SearchCutOff):
        capacity.find_witness(f, ROW[1], W.consts["K"])
