"""Expression walking and model analysis for the generators: the children and binders of
`atom_core.spec.lang` nodes, reads of parameters and ghost state, what an action modifies,
`Analysis` (per-model caches: free variables, size, totality, cost) and the key under which
alpha-equivalent subterms are shared (`canon`, `Memo`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from atom_core.spec import lang
from atom_core.spec.lang import (
    And,
    App,
    Arith,
    Cmp,
    Const,
    Count,
    Enabled,
    Expr,
    Implies,
    Ite,
    Lit,
    Op,
    Or,
    Quant,
    StateFn,
    Var,
    Vector,
)


class GenerationError(Exception):
    """The model uses something the executable core cannot express."""


def modifies(a: Any) -> tuple[list[str], list[str]]:
    """The state functions action `a` updates, in spec order: (plain, ghost)."""
    seen: dict[str, bool] = {}
    for u in a.updates:
        seen.setdefault(u.fn.name, u.fn.ghost)
    return [n for n, g in seen.items() if not g], [n for n, g in seen.items() if g]


def _children(e: Expr) -> tuple[Expr, ...]:
    try:
        return lang.children(e)
    except TypeError:
        raise GenerationError(
            f"codegen does not know the expression type {type(e).__name__}") from None


def child_flags(e: Expr) -> list[tuple[Expr, bool]]:
    """The children of `e`, each with whether it is evaluated whenever `e` is."""
    t = type(e)
    kids = _children(e)
    if t is Ite:
        return [(kids[0], True), (kids[1], False), (kids[2], False)]
    if t is And or t is Or or t is Implies:
        return [(c, i == 0) for i, c in enumerate(kids)]
    if t is Quant or t is Count or t is Vector:
        return [(kids[0], False)]
    return [(c, True) for c in kids]


def binder(e: Expr) -> Var | None:
    t = type(e)
    return e.var if (t is Quant or t is Count or t is Vector) else None


def walk(e: Expr) -> Iterator[Expr]:
    stack = [e]
    while stack:
        x = stack.pop()
        yield x
        stack.extend(reversed(_children(x)))


def reads_param(e: Expr, p: Var) -> bool:
    return any(x is p or (type(x) is App and x.fn is p) for x in walk(e))


def reads_ghost(e: Expr) -> bool:
    return any(type(x) is App and isinstance(x.fn, StateFn) and x.fn.ghost for x in walk(e))


def ghost_reads(e: Expr) -> list[str]:
    out: list[str] = []
    for x in walk(e):
        if type(x) is App and isinstance(x.fn, StateFn) and x.fn.ghost and x.fn.name not in out:
            out.append(x.fn.name)
    return out


# --------------------------------------------------------------------------- analysis


class Analysis:
    """Per-model caches: free variables, sizes, totality (nodes are immutable and shared)."""

    def __init__(self) -> None:
        self._free: dict[int, tuple[Expr, tuple[Var, ...]]] = {}
        self._size: dict[int, tuple[Expr, int]] = {}
        self._total: dict[int, tuple[Expr, bool]] = {}
        self._costly: dict[int, tuple[Expr, bool]] = {}

    def free(self, e: Expr) -> tuple[Var, ...]:
        hit = self._free.get(id(e))
        if hit is not None:
            return hit[1]
        if type(e) is Var:
            out: tuple[Var, ...] = (e,)
        else:
            acc: list[Var] = []
            bound = binder(e)
            for c in _children(e):
                for v in self.free(c):
                    if v is not bound and all(v is not w for w in acc):
                        acc.append(v)
            out = tuple(acc)
        self._free[id(e)] = (e, out)
        return out

    def size(self, e: Expr) -> int:
        hit = self._size.get(id(e))
        if hit is not None:
            return hit[1]
        n = 1 + sum(self.size(c) for c in _children(e))
        self._size[id(e)] = (e, n)
        return n

    @staticmethod
    def nullable(e: Expr) -> bool:
        """May evaluate to None (an ident-keyed function without an initial value)."""
        if type(e) is App and isinstance(e.fn, StateFn):
            return e.fn.init is None and any(a.kind == "ident" for a in e.fn.args)
        if type(e) is Ite:
            return Analysis.nullable(e.then) or Analysis.nullable(e.other)
        return False

    def total(self, e: Expr) -> bool:
        """Evaluating `e` cannot raise, whatever the (well-formed) state."""
        hit = self._total.get(id(e))
        if hit is not None:
            return hit[1]
        t = type(e)
        kids = _children(e)
        ok = all(self.total(c) for c in kids)
        if t is App:
            if isinstance(e.fn, Op):  # value-sort ops are total on values (atom_core.seq)
                ok = ok and not any(self.nullable(a) for a in e.args)
            elif isinstance(e.fn, StateFn):
                ok = ok and not any(s.kind == "index" and self.nullable(a)
                                    for a, s in zip(e.args, e.fn.args, strict=True))
            else:
                ok = ok and not any(self.nullable(a) for a in e.args)
        elif t is Arith or t is Cmp:
            ok = ok and not self.nullable(e.lhs) and not self.nullable(e.rhs)
            if t is Arith and e.op == "%":
                ok = ok and type(e.rhs) is Lit and e.rhs.value != 0
        elif t is Enabled or t is Vector:
            ok = False
        elif t is Quant or t is Count:
            ok = ok and e.var.sort.kind in ("index", "bool", "enum")
        self._total[id(e)] = (e, ok)
        return ok

    def costly(self, e: Expr) -> bool:
        """Worth computing once: reads an ident-keyed function, or loops."""
        hit = self._costly.get(id(e))
        if hit is not None:
            return hit[1]
        t = type(e)
        if t is Quant or t is Count:
            out = True
        elif t is App and isinstance(e.fn, StateFn) and any(a.kind == "ident" for a in e.fn.args):
            out = True
        else:
            out = any(self.costly(c) for c in _children(e))
        self._costly[id(e)] = (e, out)
        return out


def canon(e: Expr, hole: Var | None, binders: dict[int, int]) -> tuple[Any, ...]:
    """A key equal for alpha-equivalent terms (bound variables numbered, `hole` anonymous)."""
    t = type(e)
    if t is Lit:
        return ("L", e.sort.name, type(e.value).__name__, e.value)
    if t is Var:
        if e is hole:
            return ("H", e.sort.name)
        if id(e) in binders:
            return ("B", binders[id(e)])
        return ("P", e.name, id(e))
    if t is Const:
        return ("C", e.name)
    v = binder(e)
    if v is not None:
        inner = dict(binders)
        inner[id(v)] = len(binders)
        body = _children(e)[0]
        return (t.__name__, getattr(e, "kind", ""), v.sort.name, canon(body, hole, inner))
    head: tuple[Any, ...]
    if t is App:
        fn = e.fn
        if isinstance(fn, StateFn):
            head = ("A", "fn", fn.name, e.post)
        elif isinstance(fn, Op):
            head = ("A", "op", fn.name)
        else:
            head = ("A", "var")
    elif t is Arith or t is Cmp:
        head = (t.__name__, e.op)
    elif t is Enabled:
        head = ("E", e.action.name, tuple(e.bindings))
    else:
        head = (t.__name__,)
    return head + tuple(canon(c, hole, binders) for c in _children(e))


class Memo:
    __slots__ = ("name", "node", "hole", "key")

    def __init__(self, name: str, node: Expr, hole: Var | None, key: tuple[Any, ...]) -> None:
        self.name, self.node, self.hole, self.key = name, node, hole, key
