"""Model-based tests of atom_core.pmap.PMap against plain dicts."""

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, rule

from atom_core.pmap import PMap

KEYS = range(80)
keys = st.sampled_from(KEYS)
vals = st.none() | st.integers(min_value=0, max_value=4)
defaults = st.sampled_from([None, 0])


def model_set(m: dict, default, items) -> dict:
    m = dict(m)
    for k, v in items:
        if v == default:
            m.pop(k, None)
        else:
            m[k] = v
    return m


def check(p: PMap, default, m: dict) -> None:
    assert p.to_dict() == m
    assert len(p) == len(m)
    assert dict(p.items()) == m and len(list(p.items())) == len(m)
    assert set(p.keys()) == set(m) and set(p) == set(m)
    for k in KEYS:
        assert (k in p) == (k in m)
        assert p.get(k) == m.get(k, default)
        assert p.get(k, "absent") == m.get(k, "absent")  # a given default wins, as in dict.get
    assert p == PMap(m, default=default)


class PMapMachine(RuleBasedStateMachine):
    """Every version ever made must keep its content while later versions are derived from it
    (and from each other), across delta merges."""

    versions = Bundle("versions")

    def __init__(self) -> None:
        super().__init__()
        self.all: list[tuple[PMap, object, dict]] = []

    def _keep(self, p, default, m):
        check(p, default, m)
        self.all.append((p, default, m))
        return (p, default, m)

    @rule(target=versions, default=defaults, init=st.dictionaries(keys, vals, max_size=40))
    def new(self, default, init):
        return self._keep(PMap(init, default=default), default,
                          model_set({}, default, init.items()))

    @rule(target=versions, v=versions, k=keys, x=vals)
    def set(self, v, k, x):
        p, default, m = v
        return self._keep(p.set(k, x), default, model_set(m, default, [(k, x)]))

    @rule(target=versions, v=versions, items=st.lists(st.tuples(keys, vals), max_size=60))
    def set_many(self, v, items):
        p, default, m = v
        return self._keep(p.set_many(items), default, model_set(m, default, items))

    @rule(a=versions, b=versions)
    def compare(self, a, b):
        (p, dp, mp), (q, dq, mq) = a, b
        assert (p == q) == (dp == dq and mp == mq)

    def teardown(self):
        # Checked once at the end (each version is checked when made): see test_seq.py.
        for p, default, m in self.all:
            check(p, default, m)


TestPMapMachine = PMapMachine.TestCase


def test_long_chain_across_merges():
    p, m = PMap(default=0), {}
    history = [(p, m)]
    merges = 0
    for i in range(3000):
        k, x = (i * 7919) % 500, i % 5  # x == 0 removes
        q = p.set(k, x)
        merges += q._base is not p._base
        p, m = q, model_set(m, 0, [(k, x)])
        history.append((p, m))
    assert merges > 10  # the delta really was merged into new bases, many times
    for old, om in history[::37] + history[-5:]:
        check(old, 0, om)


def test_branches_from_one_version():
    root = PMap({i: i for i in range(1, 100)})
    a = root.set_many((i, -i) for i in range(50))  # big enough to merge
    b = root.set(1, None).set(200, "x")
    assert root.to_dict() == {i: i for i in range(1, 100)}
    assert a.get(10) == -10 and b.get(10) == 10
    assert 1 not in b and b.get(1) is None and len(b) == 99
    assert a.get(0) == 0 and 0 in a  # -0 == 0 is not the default (None): stored
    assert len(a) == 100


def test_noop_writes_return_self():
    p = PMap({1: "a"})
    assert p.set(1, "a") is p
    assert p.set(2, None) is p
    assert p.set_many({}) is p
    q = p.set(1, "b").set(1, "a")
    assert q == p and q._delta == {}  # back to the base value: no delta entry


def test_constructor_forms_and_repr():
    assert PMap([(1, 2), (3, None)]).to_dict() == {1: 2}
    assert PMap(PMap({1: 2}).set(3, 4)).to_dict() == {1: 2, 3: 4}
    assert len(PMap()) == 0 and PMap().get("x") is None
    assert PMap({1: 0}, default=0).to_dict() == {}
    assert PMap({1: 1}) != PMap({1: 1}, default=0)
    assert PMap({1: 1}) != {1: 1}
    assert repr(PMap({1: 2})) == "PMap({1: 2}, default=None)"
    with pytest.raises(TypeError):
        hash(PMap())
