"""The spec evaluated on concrete values: an executable reading independent of the generator.

`atom_core.spec.codegen` compiles each guard and update into Python with memos, loops and
early returns; a bug there (an update dropped, a conjunct skipped, a memo taken from the wrong
state) would leave the generated core disagreeing with the spec that `verify` proves. This
module reads the same expression trees a third way, by walking them over concrete values, and
shares no code with the generator, so `tests/test_differential.py` can step both side by side
and compare every guard verdict, the whole post-state (ghost state included) and the effects.

Semantics are the proofs' (`proofs/encode.py`), not the core's:

* Values: Bool and Int are Python bools and ints, an enum member its name (`"CACHE"`), an
  index or ident sort an int, a `Seq` a tuple of tokens with `take` = the first
  max(0, min(n, len)) tokens, `push` = append, `slen` = len (the meaning `encode.TokenWindow`
  gives them), a function-sorted parameter (decode's `tok`) a tuple indexed by its argument.
* `%` is z3's (the remainder of floor division by a positive divisor; undefined at 0).
* A state function without an `init` starts unspecified: the spec allows any value. Its points
  read `UNSET` until written. An expression whose value depends on an unspecified point (a
  comparison, an operation or a function argument that reads one) raises `Unspecified`;
  a point copied as it is (`ite(c, new, f(x))` at an x the step does not change) stays UNSET.
  Conjunctions, disjunctions and quantifiers are three-valued (Kleene): a false conjunct
  decides a conjunction even if another is unspecified.
* An action's updates are evaluated in the pre-state; per function a whole update
  (`assign_all`) comes first and point updates follow, later ones winning (as in
  `encode.Universe.post_state`).

`Interp(model, consts)` evaluates one configuration: `init()`, `outcome(state, action, args)`
(each guard conjunct's verdict by name, the post-state, the effects) and `enabled_calls`
(every call of an action over finite parameter domains that its guard accepts, found by
pruning on each conjunct as soon as the parameters it reads are bound). `encoded_outcome`
reads the same call through the proofs' z3 encoding instead, so the evaluator itself is checked
against what `verify` proves things about (`tests/test_differential.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from atom_core.proofs.encode import vars_in
from atom_core.spec import lang as L

__all__ = ["UNSET", "Interp", "Outcome", "Spec", "Table", "Unspecified", "encoded_outcome"]


class _Unset:
    """The value of a point the spec leaves arbitrary (no `init`, never written)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


class Unspecified(Exception):
    """An expression's value depends on a point the spec leaves arbitrary."""


def _strict(x: Any, where: str) -> Any:
    if x is UNSET:
        raise Unspecified(where)
    return x


# --------------------------------------------------------------------------- state
class Table:
    """One state function's value: explicit points over a default. The default is its `init`
    (or a whole update's body) evaluated lazily at a point, or UNSET."""

    __slots__ = ("points", "default")

    def __init__(self, points: dict[tuple[Any, ...], Any],
                 default: Callable[[tuple[Any, ...]], Any] | None) -> None:
        self.points, self.default = points, default

    def get(self, args: tuple[Any, ...]) -> Any:
        try:
            return self.points[args]
        except KeyError:
            if self.default is None:
                return UNSET
            v = self.default(args)
            self.points[args] = v  # the pre-state it reads is immutable: cache it
            return v


@attrs.frozen
class Spec:
    """A concrete state: one `Table` per state function (by name). Never mutated once built
    (a table only caches its lazy default)."""

    fns: Mapping[str, Table]

    def get(self, fn: str, *args: Any) -> Any:
        return self.fns[fn].get(tuple(args))


@attrs.frozen
class Outcome:
    """What one call of an action does: each guard conjunct's verdict (True, False, or None
    when it reads an unspecified point), in declaration order; the post-state (the pre-state
    itself when refused); the effects as (name, {arg: value}), in emission order."""

    action: str
    verdicts: tuple[tuple[str, bool | None], ...]
    post: Spec
    effects: tuple[tuple[str, dict[str, Any]], ...]

    @property
    def enabled(self) -> bool:
        return all(v is True for _, v in self.verdicts)

    @property
    def first_failing(self) -> str | None:
        """The first conjunct that does not hold (what the core's guard names), or None."""
        for name, v in self.verdicts:
            if v is not True:
                return name
        return None


# --------------------------------------------------------------------------- evaluation
def _take(q: tuple[int, ...], n: int) -> tuple[int, ...]:
    return q[:n] if n > 0 else ()


def _push(q: tuple[int, ...], t: int) -> tuple[int, ...]:
    return (*q, t)


OPS: dict[str, Callable[..., Any]] = {
    "empty": lambda: (), "take": _take, "push": _push, "slen": len}


def _mod(a: int, b: int) -> int:
    if b == 0:  # uninterpreted in z3: any value
        raise Unspecified("x % 0")
    return a % b if b > 0 else a - b * -((-a) // b)  # z3: 0 <= a % b < |b|


class Interp:
    """The model `model` under the configuration `consts` (constant name -> value; constants
    with a default may be omitted)."""

    def __init__(self, model: L.Model, consts: Mapping[str, Any]) -> None:
        self.model = model
        self.consts: dict[str, Any] = {}
        for c in model.consts:
            if c.name in consts:
                self.consts[c.name] = consts[c.name]
            elif c.default is not None:
                self.consts[c.name] = c.default
            else:
                raise ValueError(f"no value for constant {c.name}")
        unknown = set(consts) - set(self.consts)
        if unknown:
            raise ValueError(f"{model.name} has no constants {sorted(unknown)}")
        for c in model.consts:  # an index-sorted constant names a member of its sort
            if c.sort.kind == "index" and self.consts[c.name] not in self.domain(c.sort):
                raise ValueError(f"{c.name}={self.consts[c.name]!r} is not a {c.sort.name} "
                                 f"(0..{len(self.domain(c.sort)) - 1})")
        self.fns = {f.name: f for f in model.state}
        self.actions = {a.name: a for a in model.actions}
        self._level_cache: dict[str, list[list[tuple[str, L.Expr]]]] = {}

    # sorts ----------------------------------------------------------------------
    def domain(self, sort: L.Sort) -> range | tuple[Any, ...]:
        """The values of a finite sort (index: 0..size-1, enum: member names, Bool)."""
        if sort.kind == "index":
            return range(int(self.consts[sort.size]))
        if sort.kind == "enum":
            return sort.values
        if sort.kind == "bool":
            return (False, True)
        raise TypeError(f"{sort.name} is not finite: a quantifier over it has no concrete "
                        "reading here (bind it, or quantify over an index sort)")

    def axioms(self) -> list[str]:
        """The axioms the configuration breaks (laws quantify over Seq and Int: not checked)."""
        empty = Spec({})
        return [a.name for a in self.model.axioms if self._truth(a.expr, {}, empty) is not True]

    # state ----------------------------------------------------------------------
    def init(self) -> Spec:
        """The initial state: each function's `init` at every point, UNSET where it has none."""
        fns: dict[str, Table] = {}
        empty = Spec({})
        for f in self.model.state:
            init = f.init_body()
            fns[f.name] = Table({}, None if init is None else self._lazy(*init, {}, empty))
        return Spec(fns)

    def _lazy(self, vs: Sequence[L.Var], body: L.Expr, env: dict[L.Var, Any],
              s: Spec) -> Callable[[tuple[Any, ...]], Any]:
        def at(args: tuple[Any, ...]) -> Any:
            return self.ev(body, {**env, **dict(zip(vs, args, strict=True))}, s)
        return at

    # expressions ----------------------------------------------------------------
    def ev(self, e: L.Expr, env: dict[L.Var, Any], s: Spec) -> Any:
        """The value of `e` in state `s` with variables `env` (UNSET when it is an unspecified
        point read as it is)."""
        k = type(e)
        if k is L.App:
            fn = e.fn
            args = tuple(_strict(self.ev(a, env, s), f"an argument of {fn!r}") for a in e.args)
            if isinstance(fn, L.StateFn):
                if e.post:
                    raise ValueError(f"{fn.name}.post outside a transition")
                return s.fns[fn.name].get(args)
            if isinstance(fn, L.Op):
                return OPS[fn.name](*args)
            return env[fn][args[0]] if len(args) == 1 else env[fn][args]
        if k is L.Var:
            return env[e]
        if k is L.Lit:
            return e.value
        if k is L.Const:
            return self.consts[e.name]
        if k in (L.And, L.Or, L.Implies, L.Not, L.Quant):
            return self._truth(e, env, s)
        if k is L.Eq:
            a = _strict(self.ev(e.lhs, env, s), "==")
            return a == _strict(self.ev(e.rhs, env, s), "==")
        if k is L.Cmp:
            a = _strict(self.ev(e.lhs, env, s), e.op)
            b = _strict(self.ev(e.rhs, env, s), e.op)
            return a < b if e.op == "<" else a <= b
        if k is L.Arith:
            a = _strict(self.ev(e.lhs, env, s), e.op)
            b = _strict(self.ev(e.rhs, env, s), e.op)
            if e.op == "+":
                return a + b
            if e.op == "-":
                return a - b
            if e.op == "*":
                return a * b
            return _mod(a, b)
        if k is L.Ite:
            c = self._truth(e.cond, env, s)
            if c is None:
                raise Unspecified("ite condition")
            return self.ev(e.then if c else e.other, env, s)
        if k is L.Count:
            n = 0
            for x in self.domain(e.var.sort):
                c = self._truth(e.cond, {**env, e.var: x}, s)
                if c is None:
                    raise Unspecified("count")
                n += c
            return n
        if k is L.Vector:
            return tuple(self.ev(e.body, {**env, e.var: x}, s) for x in self.domain(e.var.sort))
        if k is L.Enabled:
            raise TypeError("enabled() has no concrete reading here (progress properties "
                            "quantify over unbounded parameters)")
        raise TypeError(f"cannot evaluate {k.__name__}")

    def _truth(self, e: L.Expr, env: dict[L.Var, Any], s: Spec) -> bool | None:
        """A formula's truth value, three-valued: None when it depends on an unspecified point."""
        k = type(e)
        if k is L.And or k is L.Or:
            decisive = k is L.Or  # the value that decides the connective
            unknown = False
            for a in e.args:
                v = self._truth(a, env, s)
                if v is None:
                    unknown = True
                elif v is decisive:
                    return decisive
            return None if unknown else not decisive
        if k is L.Implies:
            h = self._truth(e.hyp, env, s)
            if h is False:
                return True
            c = self._truth(e.concl, env, s)
            if c is True:
                return True
            return None if h is None or c is None else False
        if k is L.Not:
            v = self._truth(e.arg, env, s)
            return None if v is None else not v
        if k is L.Quant:
            decisive = e.kind == "exists"
            unknown = False
            for x in self.domain(e.var.sort):
                v = self._truth(e.body, {**env, e.var: x}, s)
                if v is None:
                    unknown = True
                elif v is decisive:
                    return decisive
            return None if unknown else not decisive
        try:
            v = self.ev(e, env, s)
        except Unspecified:
            return None
        if v is UNSET:
            return None
        return bool(v)

    # actions --------------------------------------------------------------------
    def bind(self, action: L.Action, args: Sequence[Any] | Mapping[str, Any]) -> dict[L.Var, Any]:
        """The parameters of `action` bound to `args` (positional or by name), range-checked."""
        if isinstance(args, Mapping):
            missing = [p.name for p in action.params if p.name not in args]
            extra = set(args) - {p.name for p in action.params}
            if missing or extra:
                raise TypeError(f"{action.name}: missing {missing}, unknown {sorted(extra)}")
            vals = [args[p.name] for p in action.params]
        else:
            if len(args) != len(action.params):
                raise TypeError(f"{action.name} takes {len(action.params)} arguments, "
                                f"got {len(args)}")
            vals = list(args)
        env: dict[L.Var, Any] = {}
        for p, v in zip(action.params, vals, strict=True):
            if p.sort.kind == "index" and v not in self.domain(p.sort):
                raise IndexError(f"{action.name}: {p.name}={v!r} is not a {p.sort.name} "
                                 f"(0..{len(self.domain(p.sort)) - 1})")
            env[p] = tuple(v) if p.sort.kind in ("value", "fn") else v
        return env

    def verdicts(self, action: L.Action, env: dict[L.Var, Any],
                 s: Spec) -> tuple[tuple[str, bool | None], ...]:
        return tuple((name, self._truth(g, env, s)) for name, g in action.guards)

    def outcome(self, s: Spec, action: str, args: Sequence[Any] | Mapping[str, Any]) -> Outcome:
        """Every guard conjunct's verdict; if all hold, the post-state and the effects."""
        act = self.actions[action]
        env = self.bind(act, args)
        verdicts = self.verdicts(act, env, s)
        if not all(v is True for _, v in verdicts):
            return Outcome(action, verdicts, s, ())
        return Outcome(action, verdicts, self.post(act, env, s), self.effects(act, env, s))

    def effects(self, action: L.Action, env: dict[L.Var, Any],
                s: Spec) -> tuple[tuple[str, dict[str, Any]], ...]:
        return tuple((eff.name, {k: self.ev(v, env, s) for k, v in eff.args.items()})
                     for eff in action.effects)

    def post(self, action: L.Action, env: dict[L.Var, Any], s: Spec) -> Spec:
        """The post-state: every right-hand side and target point in the pre-state `s`."""
        by_fn: dict[str, list[L.Update]] = {}
        for u in action.updates:
            by_fn.setdefault(u.fn.name, []).append(u)
        fns = dict(s.fns)
        for name, ups in by_fn.items():
            whole = [u for u in ups if u.whole]
            if len(whole) > 1 or (whole and ups[0] is not whole[0]):
                raise ValueError(f"{action.name}: whole update of {name} must come first, once")
            f = self.fns[name]
            if whole:
                at = self._lazy(list(whole[0].args), whole[0].value, env, s)
                if all(a.kind != "ident" for a in f.args):  # finite: evaluate it now
                    points = {args: at(args) for args in
                              itertools.product(*[self.domain(a) for a in f.args])}
                    table = Table(points, None)
                else:  # over requests: lazily, at the points someone reads
                    table = Table({}, at)
            else:
                old = s.fns[name]
                table = Table(dict(old.points), old.default)
            for u in ups:
                if u.whole:
                    continue
                where = tuple(_strict(self.ev(a, env, s), f"the point {name} updates")
                              for a in u.args)
                table.points[where] = self.ev(u.value, env, s)
            fns[name] = table
        return Spec(fns)

    # enumeration ------------------------------------------------------------------
    def enabled_calls(self, s: Spec, action: str, domains: Mapping[str, Iterable[Any]],
                      misses: int = 0) -> Iterator[tuple[tuple[Any, ...], tuple[str, ...]]]:
        """Each call of `action` with parameters from `domains` (by name) whose guard fails in
        at most `misses` conjuncts, with the conjuncts that fail (an unspecified verdict counts
        as failing). Parameters are bound in declaration order, and each conjunct is evaluated
        as soon as the parameters it reads are bound, so a failing one prunes every call below.
        """
        act = self.actions[action]
        params = act.params
        doms = [[self.bind_one(act, p, v) for v in domains[p.name]] for p in params]
        levels = self._levels(act)

        def go(i: int, env: dict[L.Var, Any],
               failed: tuple[str, ...]) -> Iterator[tuple[tuple[Any, ...], tuple[str, ...]]]:
            for name, g in levels[i]:
                if self._truth(g, env, s) is not True:
                    failed = (*failed, name)
                    if len(failed) > misses:
                        return
            if i == len(params):
                yield tuple(env[p] for p in params), failed
                return
            p = params[i]
            for v in doms[i]:
                yield from go(i + 1, {**env, p: v}, failed)

        yield from go(0, {}, ())

    def _levels(self, act: L.Action) -> list[list[tuple[str, L.Expr]]]:
        """The guard conjuncts by the number of leading parameters they need bound."""
        if act.name not in self._level_cache:
            levels: list[list[tuple[str, L.Expr]]] = [[] for _ in range(len(act.params) + 1)]
            for name, g in act.guards:
                reads = vars_in([g])
                lvl = max((i + 1 for i, p in enumerate(act.params) if p in reads), default=0)
                levels[lvl].append((name, g))
            self._level_cache[act.name] = levels
        return self._level_cache[act.name]

    def bind_one(self, action: L.Action, p: L.Var, v: Any) -> Any:
        if p.sort.kind == "index" and v not in self.domain(p.sort):
            raise IndexError(f"{action.name}: {p.name}={v!r} is not a {p.sort.name}")
        return tuple(v) if p.sort.kind in ("value", "fn") else v


# --------------------------------------------------------------------------- the z3 reading
def encoded_outcome(interp: Interp, s: Spec, action: str, args: Sequence[Any],
                    reqs: Sequence[int]) -> Outcome:
    """The same call read through the proofs' encoding (`encode.Universe`, bounded, with
    concrete token sequences): each conjunct's z3 term and each updated point's post-state term
    evaluated on the concrete pre-state `s`. A check of this evaluator against what `verify`
    proves things about; `reqs` are the requests the state names (the Req universe).
    Unspecified points become fresh z3 constants, so a verdict or value that depends on one
    stays symbolic (None, UNSET)."""
    import z3

    from atom_core.proofs.encode import Universe

    model, consts = interp.model, interp.consts
    reqs = list(reqs)
    # (an empty sort has no z3 enumeration: an index sort of size 0 gets a member nothing
    # names, whose points stay symbolic)
    sizes = {srt.name: max(1, len(reqs) if srt.kind == "ident" else int(consts[srt.size]))
             for srt in model.sorts if srt.kind in ("index", "ident")}
    u = Universe(model, sizes, consts=consts, concrete_seqs=True)
    assert u.tokens is not None

    def to_z3(v: Any, srt: L.Sort) -> Any:
        if v is UNSET:
            return z3.FreshConst(u.zsort(srt), "unset")
        if srt.kind == "value":
            pad = list(v) + [0] * (u.tokens.width - len(v))
            return u.tokens.mk(len(v), *pad)
        if srt.kind == "ident":
            return u.domain[srt.name][reqs.index(v)]
        return u.value(v, srt)

    def points(args: tuple[L.Sort, ...]) -> list[tuple[Any, ...]]:
        return list(itertools.product(*[reqs if a.kind == "ident" else interp.domain(a)
                                        for a in args]))

    def table(values: dict[tuple[Any, ...], Any], args: tuple[L.Sort, ...],
              ret: L.Sort) -> Callable[..., Any]:
        pts = [(tuple(to_z3(x, a) for x, a in zip(pt, args, strict=True)), to_z3(v, ret))
               for pt, v in values.items()]

        def fn(*zargs: Any) -> Any:
            if not pts:
                return z3.FreshConst(u.zsort(ret), "unset")
            out = pts[-1][1]
            for where, v in reversed(pts[:-1]):
                out = z3.If(z3.And([a == b for a, b in zip(zargs, where, strict=True)]), v, out)
            return out
        return fn

    env = {f.name: table({pt: s.get(f.name, *pt) for pt in points(f.args)}, f.args, f.ret)
           for f in model.state}
    act = interp.actions[action]
    bound: dict[L.Var, Any] = {}
    for p, v in zip(act.params, args, strict=True):
        if p.sort.kind == "fn":
            (arg,) = p.sort.args
            bound[p] = table({(i,): x for i, x in enumerate(v)}, (arg,), p.sort.ret)
        else:
            bound[p] = to_z3(v, p.sort)

    def concrete(t: Any, srt: L.Sort) -> Any:
        t = z3.simplify(t)
        if srt.kind == "bool":
            return True if z3.is_true(t) else False if z3.is_false(t) else UNSET
        if srt.kind == "int":
            return t.as_long() if z3.is_int_value(t) else UNSET
        if srt.kind == "value":
            if not (z3.is_app(t) and t.decl().eq(u.tokens.mk)):
                return UNSET
            parts = [concrete(c, L.INT) for c in t.children()]
            if UNSET in parts:
                return UNSET
            return tuple(parts[1:1 + parts[0]])
        for i, member in enumerate(u.domain[srt.name]):
            if z3.eq(t, member):
                return srt.values[i] if srt.kind == "enum" else reqs[i] \
                    if srt.kind == "ident" else i
        return UNSET

    verdicts = tuple((name, {True: True, False: False}.get(concrete(u.tr(g, env, bound), L.BOOL)))
                     for name, g in act.guards)
    if not all(v is True for _, v in verdicts):
        return Outcome(action, verdicts, s, ())
    post = u.post_state(act, env, bound)
    fns = dict(s.fns)
    for name in dict.fromkeys(up.fn.name for up in act.updates):
        f = interp.fns[name]
        fns[name] = Table({pt: concrete(post[name](*[to_z3(x, a) for x, a in
                                                     zip(pt, f.args, strict=True)]), f.ret)
                           for pt in points(f.args)}, None)
    return Outcome(action, verdicts, Spec(fns), ())
