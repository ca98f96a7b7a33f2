"""Model-based tests of atom_core.seq against plain tuples."""

import copy
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, rule

from atom_core.seq import TokSeq, prefix_eq, push, range_eq, seq, slen, take

# A tiny alphabet makes equal contents in different buffers (and first-token ties) common.
toks = st.integers(min_value=0, max_value=3)
tok_lists = st.lists(toks, max_size=12)


def check(s: TokSeq, model: tuple[int, ...]) -> None:
    assert s.n <= len(s.buf)
    assert s.tokens() == model
    assert tuple(s) == model
    assert len(s) == slen(s) == len(model)
    assert s == seq(model)
    assert hash(s) == hash(seq(model)) == hash(model)


class SeqMachine(RuleBasedStateMachine):
    """Random seq/take/push over a growing pool of views; every view ever made must keep its
    content, whatever is pushed onto other views sharing its buffer."""

    views = Bundle("views")

    def __init__(self) -> None:
        super().__init__()
        self.all: list[tuple[TokSeq, tuple[int, ...]]] = []

    def _keep(self, s: TokSeq, m: tuple[int, ...]) -> tuple[TokSeq, tuple[int, ...]]:
        check(s, m)
        self.all.append((s, m))
        return (s, m)

    @rule(target=views, tokens=tok_lists)
    def new(self, tokens):
        return self._keep(seq(tokens), tuple(tokens))

    @rule(target=views, v=views, n=st.integers(min_value=-2, max_value=14))
    def take(self, v, n):
        s, m = v
        t = take(s, n)
        assert t.buf is s.buf  # O(1): shared buffer
        return self._keep(t, m[: max(n, 0)])

    @rule(target=views, v=views, tok=toks)
    def push(self, v, tok):
        s, m = v
        at_end = len(s.buf) == s.n
        t = push(s, tok)
        assert (t.buf is s.buf) == at_end
        return self._keep(t, (*m, tok))

    @rule(a=views, b=views, n=st.integers(min_value=-1, max_value=14))
    def compare(self, a, b, n):
        (s, ms), (t, mt) = a, b
        assert (s == t) == (ms == mt)
        assert (s != t) == (ms != mt)
        if s == t:
            assert hash(s) == hash(t)
        expect = len(ms) >= n and len(mt) >= n and ms[: max(n, 0)] == mt[: max(n, 0)]
        assert prefix_eq(s, t, n) == expect
        assert prefix_eq(s, tuple(mt), n) == expect and prefix_eq(tuple(ms), t, n) == expect

    @rule(a=views, b=views, start=st.integers(min_value=0, max_value=14),
          stop=st.integers(min_value=0, max_value=14))
    def compare_range(self, a, b, start, stop):
        (s, ms), (t, mt) = a, b
        expect = len(ms) >= stop and len(mt) >= stop and ms[start:stop] == mt[start:stop]
        assert range_eq(s, t, start, stop) == expect
        # a plain tuple on either side (the test machines keep prompts as tuples)
        assert range_eq(s, tuple(mt), start, stop) == expect
        assert range_eq(tuple(ms), t, start, stop) == expect

    @rule(v=views, data=st.data())
    def index(self, v, data):
        s, m = v
        i = data.draw(st.integers(min_value=-len(m) - 2, max_value=len(m) + 2))
        if -len(m) <= i < len(m):
            assert s[i] == m[i]
        else:
            with pytest.raises(IndexError):
                s[i]
        idx = st.none() | st.integers(min_value=-len(m) - 2, max_value=len(m) + 2)
        step = data.draw(st.none() | st.integers(min_value=-3, max_value=3).filter(bool))
        sl = slice(data.draw(idx), data.draw(idx), step)
        assert s[sl] == m[sl]

    def teardown(self):
        # Checked once at the end (each view is checked when made): a mutation of an old
        # view would persist, and a per-step check of every view is quadratic.
        for s, m in self.all:
            check(s, m)


TestSeqMachine = SeqMachine.TestCase


def test_branching_push_keeps_both_views():
    base = seq([1, 2])
    a = push(base, 3)  # tip of base.buf: appended in place
    assert a.buf is base.buf
    b = push(base, 4)  # base is no longer the tip: copies
    assert b.buf is not base.buf
    a2 = push(a, 5)
    assert a2.buf is a.buf
    c = push(take(a2, 1), 9)
    assert (base.tokens(), a.tokens(), b.tokens(), a2.tokens(), c.tokens()) == (
        (1, 2), (1, 2, 3), (1, 2, 4), (1, 2, 3, 5), (1, 9))
    assert take(a2, 2) == base and take(a2, 2) is not base
    assert take(a2, 10) is a2


@given(tok_lists, tok_lists)
def test_eq_and_hash_by_content(x, y):
    a, b = seq(x), seq(y)
    assert (a == b) == (x == y)
    if x == y:
        assert hash(a) == hash(b)
    # same content reached through different histories
    c = seq([])
    for t in x:
        c = push(c, t)
    assert c == a and hash(c) == hash(a)
    assert {a: 1}[c] == 1


def test_eq_with_cached_hashes_and_other_types():
    a, b = seq([1, 2, 3]), seq([1, 5, 3])
    hash(a), hash(b)
    assert a != b
    assert a != (1, 2, 3)
    assert seq([]) == take(a, 0)


def test_prefix_eq_edges():
    a = seq([1, 2, 3])
    b = push(take(a, 2), 7)
    assert prefix_eq(a, b, 2) and not prefix_eq(a, b, 3)
    assert not prefix_eq(a, b, 4)
    assert prefix_eq(a, a, 3) and not prefix_eq(a, a, 4)
    assert prefix_eq(seq([]), seq([]), 0)
    assert not prefix_eq(seq([5, 1]), seq([6, 1]), 2)


def test_take_clamps():
    a = seq([1, 2, 3])
    assert take(a, -1).tokens() == () and take(a, 0).tokens() == ()
    assert take(a, 3) is a and take(a, 99) is a


def test_immutable_and_copy_pickle():
    a = push(seq([1, 2]), 3)
    with pytest.raises(AttributeError):
        a.n = 1
    with pytest.raises(AttributeError):
        a.buf = []
    with pytest.raises(AttributeError):
        del a.n
    assert copy.copy(a) is a and copy.deepcopy(a) is a
    b = pickle.loads(pickle.dumps(a))
    assert b == a and b.tokens() == (1, 2, 3)
    with pytest.raises(ValueError):
        TokSeq([1, 2], 3)


def test_tokens_must_be_integers():
    with pytest.raises(TypeError):
        seq([1.5])
    with pytest.raises(TypeError):
        seq("12")  # a string is not a sequence of token ids
    with pytest.raises(TypeError):
        seq(b"12")  # nor are bytes (an array would read them as raw integers)
    with pytest.raises(ValueError, match="64 bits"):
        seq([2 ** 64])
    with pytest.raises(TypeError):
        push(seq([]), "a")


def test_repr():
    assert repr(seq(range(1, 131))) == "TokSeq(len=130, head=(1, 2, 3, 4, 5, 6, ...))"
    assert repr(seq([7])) == "TokSeq(len=1, head=(7,))"
    assert repr(seq([])) == "TokSeq(len=0, head=())"
    assert repr(take(seq([1, 2, 3]), 2)) == "TokSeq(len=2, head=(1, 2))"


def test_long_decode_is_linear():
    s = seq([0])
    views = [s]
    for i in range(1, 20_000):
        s = push(s, i % 7)
        views.append(s)
    assert all(v.buf is s.buf for v in views)  # one buffer, no copies
    assert views[100].tokens() == tuple(i % 7 for i in range(101))
