"""The spec's laws and value axioms hold for their implementation.

The proofs treat `Seq` and its operations as uninterpreted and assume only the laws and axioms
about them (`push_adds_a_token`, `empty_has_no_tokens`), so a proof holds for any
implementation that satisfies those; the generated core runs `atom_core.seq`. This test reads
every law and every axiom that mentions a value operation from the model and evaluates it on
`atom_core.seq` for random values (hypothesis), so a new law is tested with no change here,
and an implementation that breaks one fails (planted below).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import atom_core.seq as seq_impl
from atom_core.spec import lang as L
from atom_core.spec.model import MODEL

Impl = dict[str, Callable[..., Any]]


def implementation(module: Any = seq_impl) -> Impl:
    """Each op of the model by name from the module (as the code generator binds them)."""
    return {o.name: getattr(module, o.name) for o in MODEL.ops}


def mentions_an_op(e: L.Expr) -> bool:
    stack: list[Any] = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, L.App) and isinstance(x.fn, L.Op):
            return True
        for attr in ("args", "arg", "cond", "then", "other", "hyp", "concl", "lhs", "rhs",
                     "body"):
            v = getattr(x, attr, None)
            if isinstance(v, tuple):
                stack.extend(v)
            elif isinstance(v, L.Expr):
                stack.append(v)
    return False


FACTS = [*MODEL.laws, *(a for a in MODEL.axioms if mentions_an_op(a.expr))]


def evaluate(e: L.Expr, env: dict[L.Var, Any], impl: Impl) -> Any:
    """`e` with the ops interpreted by `impl` and its variables bound by `env`."""
    ev = lambda x: evaluate(x, env, impl)  # noqa: E731
    if isinstance(e, L.Lit):
        return e.value
    if isinstance(e, L.Var):
        return env[e]
    if isinstance(e, L.App) and isinstance(e.fn, L.Op):
        return impl[e.fn.name](*[ev(a) for a in e.args])
    if isinstance(e, L.Not):
        return not ev(e.arg)
    if isinstance(e, L.And):
        return all(ev(a) for a in e.args)
    if isinstance(e, L.Or):
        return any(ev(a) for a in e.args)
    if isinstance(e, L.Implies):
        return (not ev(e.hyp)) or ev(e.concl)
    if isinstance(e, L.Ite):
        return ev(e.then) if ev(e.cond) else ev(e.other)
    if isinstance(e, L.Eq):
        return ev(e.lhs) == ev(e.rhs)
    if isinstance(e, L.Arith):
        a, b = ev(e.lhs), ev(e.rhs)
        return {"+": a + b, "-": a - b, "*": a * b}[e.op] if e.op != "%" else a % b
    if isinstance(e, L.Cmp):
        a, b = ev(e.lhs), ev(e.rhs)
        return a < b if e.op == "<" else a <= b
    raise TypeError(f"cannot evaluate {type(e).__name__} in a law: a law may quantify only at "
                    "its top (forall over values and integers) and mention only value "
                    "operations; extend tests/test_laws.py if a new law needs more")


def split(e: L.Expr) -> tuple[list[L.Var], L.Expr]:
    vs = []
    while isinstance(e, L.Quant) and e.kind == "forall":
        vs.append(e.var)
        e = e.body
    return vs, e


# Values: sequences built through the implementation's own operations too (views sharing a
# buffer, branches), since that is how the core makes them.
TOKENS = st.integers(0, 9)
RECIPES = st.recursive(
    st.lists(TOKENS, max_size=6).map(lambda ts: ("seq", ts)),
    lambda inner: st.one_of(st.tuples(st.just("take"), inner, st.integers(-2, 8)),
                            st.tuples(st.just("push"), inner, TOKENS)),
    max_leaves=8)


def build(recipe: Any, impl: Impl) -> Any:
    if recipe[0] == "seq":
        return seq_impl.seq(recipe[1])
    return impl[recipe[0]](build(recipe[1], impl), recipe[2])


def strategy(sort: L.Sort) -> st.SearchStrategy:
    if sort.kind == "value":
        return RECIPES
    if sort.kind == "int":
        return st.integers(-3, 12)
    if sort.kind == "bool":
        return st.booleans()
    raise TypeError(f"a law over {sort.name}: only value sorts, Int and Bool are generated")


def check_fact(fact: L.Named, impl: Impl, examples: int = 300) -> None:
    """Raises AssertionError (hypothesis shrinks it) if `fact` fails on `impl` for some
    values."""
    vs, body = split(fact.expr)

    @settings(max_examples=examples, deadline=None, database=None)
    @given(st.tuples(*[strategy(v.sort) for v in vs]))
    def holds(raw: tuple[Any, ...]) -> None:
        env = {v: build(x, impl) if v.sort.kind == "value" else x
               for v, x in zip(vs, raw, strict=True)}
        assert evaluate(body, env, impl) is True, f"{fact.name} fails for {raw}"

    holds()


def test_every_law_is_checked():
    assert MODEL.laws and {f.name for f in MODEL.laws} <= {f.name for f in FACTS}
    assert any(f.kind == "axiom" for f in FACTS)  # empty_has_no_tokens


@pytest.mark.parametrize("fact", FACTS, ids=lambda f: f.name)
def test_law_holds_for_atom_core_seq(fact):
    check_fact(fact, implementation())


class Planted:
    """`atom_core.seq` with one operation wrong."""

    def __init__(self, **wrong: Callable[..., Any]) -> None:
        self.wrong = wrong

    def __getattr__(self, name: str) -> Any:
        return self.wrong.get(name, getattr(seq_impl, name))


@pytest.mark.parametrize(("wrong", "fails"), [
    ({"push": lambda s, t: s}, "push_adds_a_token"),  # push drops the token
    ({"push": lambda s, t: seq_impl.push(seq_impl.push(s, t), t)}, "push_adds_a_token"),
    ({"slen": lambda s: max(0, seq_impl.slen(s) - 1) if seq_impl.slen(s) > 3 else
      seq_impl.slen(s)}, "push_adds_a_token"),  # wrong only for longer sequences
    ({"empty": lambda: seq_impl.seq([0])}, "empty_has_no_tokens"),
], ids=["push-drops", "push-twice", "slen-off-by-one-late", "empty-not-empty"])
def test_a_wrong_implementation_fails(wrong, fails):
    impl = implementation(Planted(**wrong))
    fact = next(f for f in FACTS if f.name == fails)
    with pytest.raises(AssertionError, match=fails):
        check_fact(fact, impl)
