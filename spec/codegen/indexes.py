"""`IndexEmitter`: the in-place core's maintained indexes (MState slots `_ix<i>`): which
the model's shapes call for, how each is built, keyed and kept up to date by a write, and
the loops (`where_<f>`, guard quantifiers) that read them."""

from __future__ import annotations

from typing import Any

from atom_core.spec.codegen.analysis import walk
from atom_core.spec.codegen.body import Body, base_name
from atom_core.spec.codegen.printer import render
from atom_core.spec.codegen.pure import Generator
from atom_core.spec.lang import And, App, Eq, Expr, Implies, Ite, Lit, Not, Quant, StateFn, Var


class IndexEmitter(Generator):
    """The index half of the in-place generator: `indexes` (set by the subclass from
    `_find_indexes`) and `used_ix` (the ones a loop read, set per generation)."""

    indexes: list[tuple[Any, ...]]
    used_ix: set[tuple[Any, ...]]

    def _find_indexes(self) -> list[tuple[Any, ...]]:
        """The maintained indexes (derived from the model's shapes, no spec change), in
        order:
        ("sel", f, E, g): g-value -> {x | f(x) == E and g(x) == that value}, for whole
          updates whose condition has the conjuncts f(v) == E, g(v) == w (w free of v);
        ("val", h): h-value -> {x | h(x) == that value}, for guards scanning every x for
          h(x) == e (e free of x). Each is a slot `_ix<i>` of MState, built by thaw and
          kept up to date by every write of the functions it reads."""
        model = self.model
        indexes: list[tuple[Any, ...]] = []
        for a in model.actions:
            for u in a.updates:
                if u.whole and len(u.args) == 1 and type(u.value) is Ite:
                    sel = self._sel_match(u.value.cond, u.args[0])
                    if sel is not None and sel[0] not in indexes:
                        indexes.append(sel[0])
            for _, g in a.guards:
                for x in walk(g):
                    if type(x) is Quant:
                        val = self._val_match(x, x.kind == "forall")
                        if val is not None and val[0] not in indexes:
                            indexes.append(val[0])
        for f in model.lookups:  # `where_<f>` reads an index of f
            if self.layout(f) == "tuple" and ("val", f.name) not in indexes:
                indexes.append(("val", f.name))
        return indexes

    def _indexable(self, fn: Any, v: Var) -> bool:
        return (isinstance(fn, StateFn) and not fn.ghost and len(fn.args) == 1
                and fn.args[0] is v.sort and self.layout(fn) == "tuple")

    def _at_var(self, e: Expr, v: Var) -> StateFn | None:
        """f when `e` is f(v) (pre-state) for an indexable f."""
        if type(e) is App and not e.post and len(e.args) == 1 and e.args[0] is v \
                and self._indexable(e.fn, v):
            return e.fn
        return None

    def _eqs_at(self, cond: Expr, v: Var) -> list[tuple[StateFn, Expr]]:
        """(f, w) per top-level conjunct f(v) == w of `cond` with w free of v."""
        out = []
        for c in _conjuncts(cond):
            if type(c) is not Eq:
                continue
            for lhs, rhs in ((c.lhs, c.rhs), (c.rhs, c.lhs)):
                f = self._at_var(lhs, v)
                if f is not None and not any(x is v for x in self.an.free(rhs)) \
                        and self.an.total(rhs):
                    out.append((f, rhs))
                    break
        return out

    def _sel_match(self, cond: Expr, v: Var) -> tuple[tuple[Any, ...], Expr] | None:
        eqs = self._eqs_at(cond, v)
        for f, e in eqs:
            if type(e) is not Lit or f.ret.kind != "enum":
                continue
            for g, w in eqs:
                if g is not f and g.ret.kind == "index":
                    return ("sel", f.name, e.value, g.name), w
        return None

    def _val_match(self, q: Quant, pos: bool = True) -> tuple[tuple[Any, ...], Expr] | None:
        """For a quantifier a guard requires to be `pos` whose failing instances all satisfy
        h(x) == e (a conjunct of the failing condition), ("val", h) and e."""
        if q.var.sort.kind != "index":
            return None
        body = q.body
        if q.kind == "exists" and not pos:
            fails = body  # fails where the body holds
        elif q.kind == "forall" and pos and type(body) is Not:
            fails = body.arg
        elif q.kind == "forall" and pos and type(body) is Implies and type(body.concl) is Not:
            fails = And(body.hyp, body.concl.arg)
        else:
            return None
        for h, e in self._eqs_at(fails, q.var):
            if type(e) is not Lit:  # a literal (an enum member) selects too little to pay
                return ("val", h.name), e
        return None

    def _ix_key(self, key: tuple[Any, ...], value: str) -> str:
        """The key a value index files `value` under: the value itself, or for a sequence
        its signature (length, first and last token), so that filing a new sequence never
        hashes all its tokens; equal values have equal keys, so a lookup finds a superset of
        the matches and the loop still checks the whole condition."""
        if key[0] == "val" and self.model_fn(key[1]).ret.kind == "value":
            return f"_sig({value})"
        return value

    def _ix_slot(self, key: tuple[Any, ...]) -> str:
        return f"_ix{self.indexes.index(key)}"

    def _ix_build(self, key: tuple[Any, ...], m: str) -> str:
        """An expression building index `key` from MState `m`."""
        if key[0] == "sel":
            _, f, e, g = key
            enum = self.model_fn(f).ret
            return (f"_select({m}.{f}, {self.enum_const(enum, e)}, {m}.{g})")
        sig = "_sig" if self.model_fn(key[1]).ret.kind == "value" else "None"
        return f"_by_value({m}.{key[1]}, {sig})"

    def model_fn(self, name: str) -> StateFn:
        return next(f for f in self.model.state if f.name == name)

    def _ix_pre_post(self, fname: str, x: str,
                     skip: tuple[Any, ...] | None = None) -> tuple[list[str], list[str]]:
        """Lines around a write of `fname` at `x` keeping the indexes that read it (but
        `skip`, which the caller keeps)."""
        pre: list[str] = []
        post: list[str] = []
        for key in self.indexes:
            if key == skip:
                continue
            slot = f"s.{self._ix_slot(key)}"
            if key[0] == "sel" and fname in (key[1], key[3]):
                _, f, e, g = key
                c = self.enum_const(self.model_fn(f).ret, e)
                pre.append(f"if s.{f}[{x}] == {c}:")
                pre.append(f"    {slot}[s.{g}[{x}]].discard({x})")
                post.append(f"if s.{f}[{x}] == {c}:")
                post.append(f"    {slot}.setdefault(s.{g}[{x}], set()).add({x})")
            elif key[0] == "val" and fname == key[1]:
                # refiled only when the key changes: a write that keeps it (the same
                # first chunk, say) costs two key computations and no set work
                k = self._ix_key(key, f"s.{fname}[{x}]")
                pre.append(f"_ixk = {k}")
                post.append(f"if (_ixn := {k}) != _ixk:")
                post.append(f"    _refile({slot}, _ixk, _ixn, {x})")
        return pre, post

    def _ix_rebuild(self, fname: str) -> list[str]:
        return [f"s.{self._ix_slot(k)} = {self._ix_build(k, 's')}" for k in self.indexes
                if fname in (k[1], k[3] if k[0] == "sel" else None)]

    def _where_fn(self, f: StateFn) -> str:
        """`where_<f>(s, v)` from f's value index: the x filed under v's key, checked."""
        key = ("val", f.name)
        if key not in self.indexes:
            return super()._where_fn(f)
        self.used_ix.add(key)
        # (a miss, the common case, returns before the comprehension; a list comprehension
        # sorted in place is a third cheaper than sorted() over a generator)
        return (self._where_head(f)
                + f"    xs = s.{self._ix_slot(key)}.get({self._ix_key(key, 'v')})\n"
                f"    if not xs:\n"
                f"        return []\n"
                f"    {f.name} = s.{f.name}\n"
                f"    out = [x for x in xs if {f.name}[x] == v]\n"
                f"    out.sort()\n"
                f"    return out\n")

    def _guard_nodes(self, b: Body, g: Expr, pos: bool, env: dict[int, str]) -> list[Any]:
        """A universal quantifier whose body fails only where h(x) == e loops over the x the
        value index of h gives for e (the other x cannot fail it)."""
        if type(g) is Quant and (g.kind == "forall") == pos and id(g) not in b.memo_occ \
                and not self._whole(b, g) and self.an.total(g.body):
            hit = self._val_match(g, pos)
            if hit is not None and hit[0] in self.indexes:
                self.used_ix.add(hit[0])
                name = b.fresh(base_name(g.var), env)
                e = render(b.expr(hit[1], env)[0])
                dom = f"{b.states[False]}.{self._ix_slot(hit[0])}.get(" \
                    f"{self._ix_key(hit[0], e)}, ())"
                return self._loop_nodes(b, g, name, dom, pos, env)
        return super()._guard_nodes(b, g, pos, env)


def _leaves(e: Expr) -> list[Expr]:
    """The values a (nested) conditional may take."""
    if type(e) is Ite:
        return _leaves(e.then) + _leaves(e.other)
    return [e]


def _conjuncts(e: Expr) -> list[Expr]:
    if type(e) is And:
        return [c for x in e.args for c in _conjuncts(x)]
    return [e]
