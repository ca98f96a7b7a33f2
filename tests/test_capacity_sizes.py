"""Each capacity row is shown safe at K_min and stuck at K_min - 1 in one configuration: the
table is proved at the sizes its tight runs are searched at (chunk 2, block 8), and each row's
minimum is proved again at the typical eager artifact's sizes (chunk 128, block 4096)."""

from __future__ import annotations

import pytest

from atom_core.proofs import capacity, checks, run, search, witness
from atom_core.spec.model import MODEL

pytestmark = pytest.mark.usefixtures("fresh_z3")


def test_the_table_is_proved_at_the_tight_runs_sizes() -> None:
    assert (capacity.TABLE_CHUNK, capacity.TABLE_SEQ_LEN) == (search.TRACE_CHUNK,
                                                             search.TRACE_SEQ_LEN)
    tight, _single = witness.committed()
    assert tight
    for (name, b), w in tight.items():
        assert (w.consts["C"], w.consts["S"]) == (capacity.TABLE_CHUNK,
                                                  capacity.TABLE_SEQ_LEN), (name, b)


def test_verify_proves_each_minimum_at_both_sizes() -> None:
    rep = run.verify(MODEL, max_lanes=1, max_blocks=3, parts=("capacity",))
    small = f",C={capacity.TABLE_CHUNK},S={capacity.TABLE_SEQ_LEN}"
    by_size: dict[str, set[str]] = {}
    for c in rep.checks:
        if c.kind == "capacity" and c.size:
            by_size.setdefault(c.size, set()).add(c.status)
    rows = [r for r in rep.rows if r.minimum.get(1) is not None]
    assert rows
    for r in rows:
        k = r.minimum[1]
        at = f"B=1,K={k},{r.features.name}"
        assert by_size.get(at + small) == {"proved"}, at  # the table's own proof
        assert by_size.get(at) == {"proved"}, at  # again at chunk 128, block 4096
        if k > 1:  # and stuck one below, at the table's sizes
            assert r.traces.get(1) is not None, at
    # at the artifact's sizes, each row's minimum alone (not the whole column)
    assert {s for s in by_size if "S=" not in s} == {
        f"B=1,K={r.minimum[1]},{r.features.name}" for r in rows}
    assert checks.CHUNK == 128 and checks.SEQ_LEN == 4096


@pytest.mark.parametrize("lanes,blocks", [(2, 3), (1, 8)])
def test_progress_asked_together_decides_as_each_combination_alone(lanes: int,
                                                                   blocks: int) -> None:
    """`checks.progress` first asks every feature combination and property of a size in one
    query: its verdicts (and the properties it names as broken) are those of each combination
    asked alone. B = 2, K = 3 is below some rows' minimum (the joint query finds a stuck state
    and each combination is decided on its own), B = 1, K = 8 above every one (one query)."""
    size = dict(seq_len=capacity.TABLE_SEQ_LEN, chunk=capacity.TABLE_CHUNK)
    together = capacity.progress_by_features(MODEL, lanes, blocks, **size)
    verdicts = {"proved": 0, "counterexample": 0}
    assert len(together) > 1
    for f, cs in together.items():
        alone = capacity.progress_by_features(MODEL, lanes, blocks, only=(f,), **size)[f]
        assert [(c.invariant, c.status) for c in cs] == [(c.invariant, c.status)
                                                         for c in alone], f.name
        for c in cs:
            verdicts[c.status] += 1
    if (lanes, blocks) == (2, 3):
        assert verdicts["proved"] and verdicts["counterexample"], verdicts
    else:
        assert not verdicts["counterexample"], verdicts
