"""Spec -> z3.

Two universes:
  unbounded  index and ident sorts are uninterpreted (z3 DeclareSort) and quantifiers stay
             quantifiers, so a proof holds for every number of lanes, blocks and requests;
  bounded    index and ident sorts are finite enumerations of a given size and quantifiers are
             expanded, for counting invariants, progress and bounded model checking.

A state is an environment: for each state function, a Python callable from z3 argument terms to
a z3 term. The post-state of an action is the pre-state with the updates substituted (an
if-then-else over the updated points), so an induction query has no quantified frame axioms.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import z3

from atom_core.spec import lang as L

Env = dict[str, Callable[..., Any]]



class TokenWindow:
    """Token sequences of at most `width` tokens as (length, t0 .. t{width-1}) with the slots past
    the length zero, so equal sequences are equal tuples. This is the meaning `atom_core.seq` gives
    take / push / slen, in quantifier-free integer arithmetic, which z3 searches far faster than its
    general sequence theory."""

    def __init__(self, name: str, width: int) -> None:
        self.width = width
        dt = z3.Datatype(name)
        dt.declare("mk", ("len", z3.IntSort()), *[(f"t{i}", z3.IntSort()) for i in range(width)])
        self.sort = dt.create()
        self.mk = self.sort.mk
        self.len = self.sort.len
        self.slot = [getattr(self.sort, f"t{i}") for i in range(width)]
        self._memo: dict[tuple[int, Any], tuple[Any, Any, Any]] = {}

    def ops(self) -> dict[str, Callable[..., Any]]:
        return {"take": self.take, "push": self.push, "slen": self.len,
                "empty": lambda: self.mk(0, *[0] * self.width)}

    def _known(self, s: Any) -> list[int] | None:
        """The tokens of a sequence term built from literals, else None."""
        if not (z3.is_app(s) and s.decl().eq(self.mk)):
            return None
        args = s.children()
        if not all(z3.is_int_value(a) for a in args):
            return None
        n = args[0].as_long()
        return [a.as_long() for a in args[1:1 + n]] if 0 <= n <= self.width else None

    def _literal(self, toks: list[int]) -> Any:
        return self.mk(len(toks), *(toks + [0] * (self.width - len(toks))))

    def take(self, s: Any, n: Any) -> Any:
        # A replayed run's sequences are literals: computed here, not as a term per slot (the
        # replays of `verify` spent most of their time building those terms).
        known = self._known(s)
        if known is not None and (isinstance(n, int) or z3.is_int_value(n)):
            m = n if isinstance(n, int) else n.as_long()
            return self._literal(known[:max(0, m)])
        k = (s.get_id(), n.get_id() if z3.is_ast(n) else n)
        if k not in self._memo:  # guards re-take the same prefixes for every choice
            m = z3.simplify(z3.If(n < self.len(s), z3.If(n < 0, 0, n), self.len(s)))
            # s and n ride along so their ids stay theirs (z3 reuses ids of freed terms)
            self._memo[k] = (s, n, self.mk(m, *[z3.If(i < m, self.slot[i](s), 0)
                                                for i in range(self.width)]))
        return self._memo[k][2]

    def push(self, s: Any, t: Any) -> Any:
        known = self._known(s)
        if known is not None and z3.is_int_value(t) and len(known) < self.width:
            return self._literal(known + [t.as_long()])
        ln = self.len(s)
        return self.mk(ln + 1, *[z3.If(i < ln, self.slot[i](s), z3.If(i == ln, t, 0))
                                 for i in range(self.width)])

    def well_formed(self, s: Any) -> Any:
        ln = self.len(s)
        return z3.And(ln >= 0, ln <= self.width,
                      *[z3.Implies(i >= ln, self.slot[i](s) == 0) for i in range(self.width)])

    def tokens(self, v: Any, zm: Any) -> list[int]:
        n = max(0, min(self.width, zm.eval(self.len(v), model_completion=True).as_long()))
        return [zm.eval(self.slot[i](v), model_completion=True).as_long() for i in range(n)]
_UNIVERSES = itertools.count()
_SKOLEMS = itertools.count()


def reset_names() -> None:
    """Number universes from 0 again. Only together with a fresh z3 context (the old names are
    then gone): a query's symbol names steer z3's search, so this makes what a test gets from
    z3 independent of what ran before it in the process."""
    global _UNIVERSES, _SKOLEMS
    _UNIVERSES, _SKOLEMS = itertools.count(), itertools.count()


class Universe:
    def __init__(self, model: L.Model, sizes: dict[str, int] | None = None,
                 consts: dict[str, Any] | None = None, ctx_name: str = "",
                 concrete_seqs: bool = False) -> None:
        """`sizes` maps index/ident sort names to a size (bounded); None = unbounded.
        `consts` fixes config constants to Python values (others stay symbolic).
        `concrete_seqs` gives the value sort Seq z3's sequence theory (take = prefix, push =
        append, slen = length) so that a counterexample trace is realizable with real tokens;
        proofs leave it uninterpreted, so they hold for any implementation of those ops."""
        self.model = model
        self.bounded = sizes is not None
        # the laws of the value operations, quantified: unbounded proofs only. Bounded induction
        # stays quantifier-free (no invariant it proves reads a law); a finite universe searched
        # for a refutation instantiates them on its ground terms instead (`law_instances`).
        self.laws = not self.bounded and not concrete_seqs
        self.sizes = sizes or {}
        # Every symbol of a universe is its own: z3's global context never shares a declaration
        # between two universes (a sort, function or constant declared twice is the same one).
        uid = f"{ctx_name}#{next(_UNIVERSES)}"
        self.tag = uid
        self._literal_sorts: set[str] | None = None
        self._literal_ids: set[int] | None = None
        self.z3sorts: dict[str, Any] = {}
        self.domain: dict[str, list[Any]] = {}
        for s in model.sorts:
            if s.kind == "enum":
                zs, members = z3.EnumSort(f"{s.name}{uid}", [f"{v}{uid}" for v in s.values])
                self.z3sorts[s.name], self.domain[s.name] = zs, list(members)
            elif s.kind in ("index", "ident"):
                if self.bounded:
                    n = self.sizes[s.name]
                    zs, members = z3.EnumSort(f"{s.name}{uid}",
                                              [f"{s.name.lower()}{i}{uid}" for i in range(n)])
                    self.z3sorts[s.name], self.domain[s.name] = zs, list(members)
                else:
                    self.z3sorts[s.name] = z3.DeclareSort(f"{s.name}{uid}")
            elif s.kind == "value":
                self.z3sorts[s.name] = z3.DeclareSort(f"{s.name}{uid}")
        self.consts: dict[str, Any] = {}
        fixed = consts or {}
        for c in model.consts:
            if c.name in fixed:
                self.consts[c.name] = self.value(fixed[c.name], c.sort)
            else:
                self.consts[c.name] = z3.Const(f"{c.name}{uid}", self.zsort(c.sort))
        for s in model.sorts:  # a bounded index sort's size constant is its size
            if self.bounded and s.kind == "index" and s.size in self.consts:
                self.consts[s.size] = z3.IntVal(self.sizes[s.name])
        self.ops: dict[str, Any] = {
            o.name: z3.Function(f"{o.name}{uid}", *[self.zsort(a) for a in o.args],
                                self.zsort(o.ret))
            for o in model.ops}
        self.seq_facts: list[Any] = []  # well-formedness of free sequence terms
        self.tokens: TokenWindow | None = None
        if concrete_seqs:
            # a lane never holds more than a table (T * S tokens), plus one sampled
            width = int(fixed["S"]) * int(fixed.get("T", 1)) + 1
            self.tokens = TokenWindow(f"Tokens{uid}", width)
            self.z3sorts["Seq"] = self.tokens.sort
            self.ops.update(self.tokens.ops())

    # sorts and values ---------------------------------------------------------
    def zsort(self, s: L.Sort) -> Any:
        if s.kind == "bool":
            return z3.BoolSort()
        if s.kind == "int":
            return z3.IntSort()
        return self.z3sorts[s.name]

    def value(self, v: Any, s: L.Sort) -> Any:
        if s.kind == "bool":
            return z3.BoolVal(bool(v))
        if s.kind == "int":
            return z3.IntVal(int(v))
        if s.kind == "enum":
            return self.domain[s.name][s.index(v) if isinstance(v, str) else int(v)]
        if s.name in self.domain:
            return self.domain[s.name][int(v)]
        raise TypeError(f"no literal of sort {s.name}")

    def finite(self, s: L.Sort) -> bool:
        return s.name in self.domain

    # state ----------------------------------------------------------------------
    def fresh_state(self, tag: str, fns: Sequence[L.StateFn] | None = None) -> Env:
        """Every state function (or those of `fns`) as a fresh symbol."""
        env: Env = {}
        for f in self.model.state if fns is None else fns:
            if f.args:
                zf = z3.Function(f"{f.name}@{tag}{self.tag}",
                                 *[self.zsort(a) for a in f.args], self.zsort(f.ret))
                env[f.name] = zf
            else:
                c = z3.Const(f"{f.name}@{tag}{self.tag}", self.zsort(f.ret))
                env[f.name] = lambda c=c: c
        return env

    def init_state(self, tag: str = "init") -> Env:
        """Functions with an init expression are that expression; the rest are arbitrary."""
        env = self.fresh_state(tag)
        for f in self.model.state:
            if (init := f.init_body()) is not None:
                env[f.name] = self._lambda(*init, env)
        return env

    def _lambda(self, vs: Sequence[L.Var], body: L.Expr, env: Env,
                bound: dict[L.Var, Any] | None = None) -> Callable[..., Any]:
        def fn(*zargs: Any) -> Any:
            b = dict(bound or {})
            b.update(zip(vs, zargs, strict=True))
            return self.tr(body, env, b)
        return fn

    def params(self, action: L.Action, tag: str) -> dict[L.Var, Any]:
        out: dict[L.Var, Any] = {}
        for p in action.params:
            name = f"{action.name}.{p.name}@{tag}{self.tag}"
            if p.sort.kind == "fn":
                out[p] = z3.Function(name, *[self.zsort(a) for a in p.sort.args],
                                     self.zsort(p.sort.ret))
            else:
                out[p] = z3.Const(name, self.zsort(p.sort))
                if self.tokens is not None and p.sort.kind == "value":
                    self.seq_facts.append(self.tokens.well_formed(out[p]))
        return out

    def canonical(self, terms: Sequence[Any]) -> list[Any]:
        """Facts that choose, among the queries that differ only by renaming the elements of a
        finite sort, one: the first of the symbolic constants and `terms` of a sort is its
        first element, the next one of its first two, and so on (elements a fixed constant
        names come first and stay put). Sound for a sort no expression of the model names an
        element of (`literal_sorts`): renaming the elements of such a sort in a model of the
        query gives a model of it, and some renaming meets these facts. Empty when unbounded.

        Bounded step queries take the action's parameters this way: at B = 4, K = 7 they run
        3.8 times faster (z3 no longer tries each lane as the acting one)."""
        if not self.bounded:
            return []
        if self._literal_sorts is None:
            self._literal_sorts = literal_sorts(self.model)
        chains: dict[str, list[Any]] = {}
        fixed: dict[str, set[int]] = {}
        for c in self.model.consts:  # symbolic constants lead their sort's chain
            if c.sort.name in self.domain and c.sort.kind in ("index", "ident"):
                z = self.consts[c.name]
                at = [i for i, d in enumerate(self.domain[c.sort.name]) if z.eq(d)]
                if at:
                    fixed.setdefault(c.sort.name, set()).add(at[0])
                else:
                    chains.setdefault(c.sort.name, []).append(z)
        finite = {self.z3sorts[s.name]: s.name for s in self.model.sorts
                  if s.kind in ("index", "ident") and s.name in self.domain}
        for t in terms:
            if z3.is_expr(t) and t.sort() in finite:
                chains.setdefault(finite[t.sort()], []).append(t)
        out = []
        for sname, chain in chains.items():
            first = len(fixed.get(sname, ()))
            if sname in self._literal_sorts or fixed.get(sname, set()) != set(range(first)):
                continue  # (elements told apart: no renaming is free)
            dom = self.domain[sname]
            for i, t in enumerate(chain):
                if first + i + 1 < len(dom):
                    out.append(z3.Or([t == d for d in dom[:first + i + 1]]))
        return out

    def refuting(self, e: L.Expr, env: Env, bound: dict[L.Var, Any], post: Env | None = None,
                 chain: Sequence[Any] = (), symmetric: bool = True) -> list[Any]:
        """Facts satisfiable exactly when `e` can fail: a counterexample names its culprits, so
        the variables a refutation chooses (`e`'s universal ones, its hypotheses' existential
        ones) become fresh constants, taken canonically after `chain` (see `canonical`). Over
        a finite sort that is one instance of a body where expanding the quantifier gives one
        per element (progress at B = 4, K = 8 ran twice as fast). `symmetric=False` for a
        query that names elements (a replayed run's arguments): no canonical choice then."""
        chosen: list[Any] = []

        def pick(v: L.Var, b: dict[L.Var, Any]) -> dict[L.Var, Any]:
            c = z3.Const(f"{v.name}!{next(_SKOLEMS)}{self.tag}", self.zsort(v.sort))
            chosen.append(c)
            return {**b, v: c}

        def holds(x: L.Expr, b: dict[L.Var, Any]) -> list[Any]:
            if isinstance(x, L.Quant) and x.kind == "exists":
                return holds(x.body, pick(x.var, b))
            if isinstance(x, L.And):
                return [f for a in x.args for f in holds(a, b)]
            if isinstance(x, L.Not):
                return fails(x.arg, b)
            return [self.tr(x, env, b, post)]

        def fails(x: L.Expr, b: dict[L.Var, Any]) -> list[Any]:
            if isinstance(x, L.Quant) and x.kind == "forall":
                return fails(x.body, pick(x.var, b))
            if isinstance(x, L.Implies):
                return holds(x.hyp, b) + fails(x.concl, b)
            if isinstance(x, L.Or):
                return [f for a in x.args for f in fails(a, b)]
            if isinstance(x, L.Not):
                return holds(x.arg, b)
            return [z3.Not(self.tr(x, env, b, post))]

        out = fails(e, dict(bound))
        return out + (self.canonical([*chain, *chosen]) if symmetric else [])

    def guard(self, action: L.Action, env: Env, bound: dict[L.Var, Any]) -> Any:
        return z3.And([self.tr(g, env, bound) for _, g in action.guards])

    def post_state(self, action: L.Action, env: Env, bound: dict[L.Var, Any]) -> Env:
        """The pre-state with `action`'s updates applied (all right-hand sides in the pre-state)."""
        post = dict(env)
        by_fn: dict[str, list[L.Update]] = {}
        for u in action.updates:
            by_fn.setdefault(u.fn.name, []).append(u)
        for name, ups in by_fn.items():
            whole = [u for u in ups if u.whole]
            points = [u for u in ups if not u.whole]
            if len(whole) > 1 or (whole and ups[0] is not whole[0]):
                raise ValueError(f"{action.name}: whole update of {name} must come first, once")
            base = (self._lambda(list(whole[0].args), whole[0].value, env, bound) if whole
                    else env[name])
            post[name] = self._points(base, points, env, bound)
        return post

    def _points(self, base: Callable[..., Any], points: list[L.Update], env: Env,
                bound: dict[L.Var, Any]) -> Callable[..., Any]:
        where = [[self.tr(a, env, bound) for a in u.args] for u in points]
        vals = [self.tr(u.value, env, bound) for u in points]

        def fn(*zargs: Any) -> Any:
            # later updates win; one that hits or misses this point by its literals (a
            # replayed run's) is decided here, not left to z3 as an if-then-else
            outer: list[tuple[Any, Any]] = []
            for w, v in reversed(list(zip(where, vals, strict=True))):
                same = self._same_point(zargs, w)
                if same is True:
                    out = v
                    break
                if same is None:
                    outer.append((z3.And([a == b for a, b in zip(zargs, w, strict=True)]), v))
            else:
                out = base(*zargs)
            for cond, v in reversed(outer):
                out = z3.If(cond, v, out)
            return out
        return fn

    def _same_point(self, xs: Sequence[Any], ys: Sequence[Any]) -> bool | None:
        """Whether two argument tuples are equal, when their literals decide it."""
        known = True
        for x, y in zip(xs, ys, strict=True):
            if x.eq(y):
                continue
            if self._is_literal(x) and self._is_literal(y):
                return False
            known = False
        return True if known else None

    def _is_literal(self, x: Any) -> bool:
        if self._literal_ids is None:
            self._literal_ids = {d.get_id() for dom in self.domain.values() for d in dom}
        return (x.get_id() in self._literal_ids or z3.is_int_value(x) or z3.is_true(x)
                or z3.is_false(x))

    # terms ----------------------------------------------------------------------
    def tr(self, e: L.Expr, env: Env, bound: dict[L.Var, Any],
           post: Env | None = None) -> Any:
        t = lambda x: self.tr(x, env, bound, post)  # noqa: E731
        if isinstance(e, L.Lit):
            return self.value(e.value, e.sort)
        if isinstance(e, L.Var):
            return bound[e]
        if isinstance(e, L.Const):
            return self.consts[e.name]
        if isinstance(e, L.App):
            args = [t(a) for a in e.args]
            if isinstance(e.fn, L.StateFn):
                if e.post:
                    if post is None:
                        raise ValueError(f"{e.fn.name}.post outside a transition invariant")
                    return post[e.fn.name](*args)
                return env[e.fn.name](*args)
            if isinstance(e.fn, L.Op):
                return self.ops[e.fn.name](*args)
            return bound[e.fn](*args)
        if isinstance(e, L.Ite):
            c = t(e.cond)
            if self.tokens is not None:  # a replayed run's state: mostly literals
                c = z3.simplify(c)
            if z3.is_true(c) or z3.is_false(c):
                return t(e.then) if z3.is_true(c) else t(e.other)
            return z3.If(c, t(e.then), t(e.other))
        if isinstance(e, L.Not):
            return z3.Not(t(e.arg))
        if isinstance(e, L.And):
            return z3.And([t(a) for a in e.args])
        if isinstance(e, L.Or):
            return z3.Or([t(a) for a in e.args])
        if isinstance(e, L.Implies):
            return z3.Implies(t(e.hyp), t(e.concl))
        if isinstance(e, L.Eq):
            return t(e.lhs) == t(e.rhs)
        if isinstance(e, L.Arith):
            a, b = t(e.lhs), t(e.rhs)
            return {"+": a + b, "-": a - b, "*": a * b}[e.op] if e.op != "%" else a % b
        if isinstance(e, L.Cmp):
            a, b = t(e.lhs), t(e.rhs)
            return a < b if e.op == "<" else a <= b
        if isinstance(e, L.Quant):
            return self._quant(e, env, bound, post)
        if isinstance(e, L.Count):
            if not self.finite(e.var.sort):
                raise ValueError("counting needs a bounded universe")
            return z3.Sum([z3.If(self.tr(e.cond, env, {**bound, e.var: x}, post), 1, 0)
                           for x in self.domain[e.var.sort.name]] or [z3.IntVal(0)])
        if isinstance(e, L.Enabled):
            return self.enabled(e, env, bound)
        raise TypeError(f"cannot translate {type(e).__name__}")

    def _quant(self, e: L.Quant, env: Env, bound: dict[L.Var, Any], post: Env | None) -> Any:
        s = e.var.sort
        if self.finite(s):
            parts = [self.tr(e.body, env, {**bound, e.var: x}, post) for x in self.domain[s.name]]
            return z3.And(parts) if e.kind == "forall" else z3.Or(parts)
        x = z3.Const(f"{e.var.name}{self.tag}", self.zsort(s))
        body = self.tr(e.body, env, {**bound, e.var: x}, post)
        return z3.ForAll([x], body) if e.kind == "forall" else z3.Exists([x], body)

    def enabled(self, e: L.Enabled, env: Env, bound: dict[L.Var, Any]) -> Any:
        """The guard of the (possibly mutated) action of that name, existentially closed."""
        action = self.model.get_action(e.action.name)
        b = dict(bound)
        free: list[L.Var] = []
        for p in action.params:
            if p.name in e.bindings:
                b[p] = self.tr(e.bindings[p.name], env, bound)
            else:
                free.append(p)
        used = vars_in([g for _, g in action.guards])
        free_used = [p for p in free if p in used]
        for p in free:
            if p not in used:  # any value will do; a fresh symbol keeps it unconstrained
                b[p] = self.params_one(action, p)
        if not free_used:
            return self.guard(action, env, b)
        fin = [p for p in free_used if self.finite(p.sort)]
        sym = [p for p in free_used if not self.finite(p.sort)]
        if sym and self.bounded:
            raise ValueError(f"enabled({action.name}): bind {[p.name for p in sym]}")
        zs = {p: z3.Const(f"{action.name}.{p.name}.e{self.tag}", self.zsort(p.sort)) for p in sym}
        # Each conjunct is translated once per value of the free parameters it reads.
        uses = [[i for i, p in enumerate(fin) if p in vars_in([g])] for _, g in action.guards]
        memo: dict[tuple[int, tuple[int, ...]], Any] = {}
        alts = []
        for combo in itertools.product(*[self.domain[p.sort.name] for p in fin]):
            bb = {**b, **dict(zip(fin, combo, strict=True)), **zs}
            parts = []
            for j, (_, g) in enumerate(action.guards):
                k = (j, tuple(combo[i].get_id() for i in uses[j]))
                if k not in memo:
                    memo[k] = self.tr(g, env, bb)
                parts.append(memo[k])
            alts.append(z3.And(parts))
        out = z3.Or(alts)
        return z3.Exists(list(zs.values()), out) if zs else out

    def params_one(self, action: L.Action, p: L.Var) -> Any:
        name = f"{action.name}.{p.name}.any{self.tag}"
        if p.sort.kind == "fn":
            return z3.Function(name, *[self.zsort(a) for a in p.sort.args],
                               self.zsort(p.sort.ret))
        return z3.Const(name, self.zsort(p.sort))

    def axioms(self) -> list[Any]:
        """The config axioms, and in the unbounded universe the laws of the value operations
        (bounded queries stay quantifier-free; concrete sequences implement the laws)."""
        laws = self.model.laws if self.laws else []
        return [self.tr(a.expr, {}, {}) for a in [*self.model.axioms, *laws]]

    def law_instances(self, facts: list[Any],
                      laws: Sequence[L.Named] | None = None) -> list[Any]:
        """Each law instantiated on every ground application of its trigger in `facts`: the
        one operation application in the law's body that mentions all of its variables
        (`slen(push(q, t)) == slen(q) + 1` on each `push(a, b)`). Quantifier-free, so a
        finite-universe query stays decidable, and a model of `facts + law_instances(facts)`
        can be completed to one of the laws (each trigger term is covered, and the others
        are unconstrained)."""
        out: list[Any] = []
        for law in self.model.laws if laws is None else laws:
            e, vs = law.expr, []
            while isinstance(e, L.Quant) and e.kind == "forall":
                vs.append(e.var)
                e = e.body
            xs = [z3.FreshConst(self.zsort(v.sort), v.name) for v in vs]
            body = self.tr(e, {}, dict(zip(vs, xs, strict=True)))
            triggers = {t.decl() for t in _apps(body)
                        if t.num_args() == len(xs)
                        and all(z3.eq(a, x) for a, x in zip(t.children(), xs, strict=True))}
            if len(triggers) != 1:
                raise ValueError(f"law {law.name}: no single operation application mentions "
                                 "all its variables, so it cannot be instantiated on ground terms")
            (trig,) = triggers
            for g in _apps(*facts):
                if g.decl() == trig:
                    out.append(z3.substitute(body, *zip(xs, g.children(), strict=True)))
        return out


def subexprs(exprs: list[L.Expr]) -> Iterator[L.Expr]:
    """Every node of the expressions (see `lang.children`)."""
    stack: list[Any] = list(exprs)
    while stack:
        e = stack.pop()
        yield e
        stack.extend(L.children(e))


def vars_in(exprs: list[L.Expr]) -> set[L.Var]:
    """The variables the expressions read (free or bound: callers intersect with parameters),
    a state function applied through a variable included."""
    return {e for e in subexprs(exprs) if isinstance(e, L.Var)}


def model_exprs(model: L.Model) -> list[L.Expr]:
    """Every expression the model states: axioms, laws, invariants, progress properties,
    initial values, and each action's guards, updates and effects."""
    out = [n.expr for n in (*model.axioms, *model.laws, *model.invariants,
                            *model.transition_invariants, *model.progress)]
    out += [init[1] for f in model.state if (init := f.init_body()) is not None]
    for a in model.actions:
        out += [g for _, g in a.guards]
        for u in a.updates:
            out += [*u.args, u.value]
        for eff in a.effects:
            out += list(eff.args.values())
    return out


def literal_sorts(model: L.Model) -> set[str]:
    """The index and ident sorts some expression of the model names an element of (a literal:
    lane 0, block 3). A query over the others cannot tell their elements apart."""
    return {e.sort.name for e in subexprs(model_exprs(model))
            if isinstance(e, L.Lit) and e.sort.kind in ("index", "ident")}


def _apps(*roots: Any) -> Iterator[Any]:
    """Every distinct ground application subterm of the z3 terms `roots` (shared ones once)."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        t = stack.pop()
        # a quantifier's body holds bound variables, not ground terms
        if not z3.is_app(t) or t.get_id() in seen:
            continue
        seen.add(t.get_id())
        yield t
        stack.extend(t.children())
