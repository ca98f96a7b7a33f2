"""The spec language: sorts, state functions, actions (guard + updates), invariants.

A spec is plain Python that builds a small expression tree. The tree has two readers:
`atom_core.proofs` turns it into z3 queries, and `atom_core.spec.codegen` turns it into the
executable core. Nothing else interprets it, so a guard or update written here exists once.

The style follows mypyvy: sorts, state relations and functions, one transition = named guard
conjuncts + updates over the pre-state (parallel assignment), one invariant per line.

Sorts come in kinds that matter to both readers:
  index  finite, 0..N-1 with N a config constant (lanes, blocks); tuples in the core,
         uninterpreted (all sizes) or enumerated (one size) in z3
  ident  unbounded identities (requests); a persistent map in the core
  value  opaque data (token sequences); interpreted by `atom_core.seq` in the core,
         uninterpreted in z3, so a proof holds for every implementation of its ops
  enum, int, bool
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterable
from typing import Any

# --------------------------------------------------------------------------- sorts


class Sort:
    __slots__ = ("name", "kind", "values", "size", "args", "ret")

    def __init__(self, name: str, kind: str, values: tuple[str, ...] = (), size: str = "",
                 args: tuple[Sort, ...] = (), ret: Sort | None = None) -> None:
        self.name, self.kind, self.values, self.size = name, kind, values, size
        self.args, self.ret = args, ret

    def __getattr__(self, item: str) -> Lit:
        # Enum members read as Owner.FREE.
        if item in object.__getattribute__(self, "values"):
            return Lit(item, self)
        raise AttributeError(item)

    def __repr__(self) -> str:
        return self.name

    def index(self, member: str) -> int:
        return self.values.index(member)


BOOL = Sort("Bool", "bool")
INT = Sort("Int", "int")


def index_sort(name: str, size: str) -> Sort:
    return Sort(name, "index", size=size)


def ident_sort(name: str) -> Sort:
    return Sort(name, "ident")


def value_sort(name: str) -> Sort:
    return Sort(name, "value")


def enum_sort(name: str, members: str) -> Sort:
    return Sort(name, "enum", values=tuple(members.split()))


def fn_sort(*args: Sort, ret: Sort) -> Sort:
    return Sort(f"({', '.join(a.name for a in args)}) -> {ret.name}", "fn", args=args, ret=ret)


# --------------------------------------------------------------------------- expressions


class Expr:
    """A term. Operators build terms; `bool(expr)` is an error so misuse is loud."""

    __slots__ = ("sort",)
    sort: Sort

    def __bool__(self) -> bool:
        raise TypeError("a spec expression has no truth value; use &, |, ~, implies()")

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> Expr:  # type: ignore[override]
        return Eq(self, lift(other, self.sort))

    def __ne__(self, other: object) -> Expr:  # type: ignore[override]
        return Not(Eq(self, lift(other, self.sort)))

    def __and__(self, other: Any) -> Expr:
        return And(self, lift(other, BOOL))

    def __rand__(self, other: Any) -> Expr:
        return And(lift(other, BOOL), self)

    def __or__(self, other: Any) -> Expr:
        return Or(self, lift(other, BOOL))

    def __ror__(self, other: Any) -> Expr:
        return Or(lift(other, BOOL), self)

    def __invert__(self) -> Expr:
        return Not(self)

    def __add__(self, other: Any) -> Expr:
        return Arith("+", self, lift(other, INT))

    def __radd__(self, other: Any) -> Expr:
        return Arith("+", lift(other, INT), self)

    def __sub__(self, other: Any) -> Expr:
        return Arith("-", self, lift(other, INT))

    def __rsub__(self, other: Any) -> Expr:
        return Arith("-", lift(other, INT), self)

    def __mul__(self, other: Any) -> Expr:
        return Arith("*", self, lift(other, INT))

    def __mod__(self, other: Any) -> Expr:
        return Arith("%", self, lift(other, INT))

    def __lt__(self, other: Any) -> Expr:
        return Cmp("<", self, lift(other, INT))

    def __le__(self, other: Any) -> Expr:
        return Cmp("<=", self, lift(other, INT))

    def __gt__(self, other: Any) -> Expr:
        return Cmp("<", lift(other, INT), self)

    def __ge__(self, other: Any) -> Expr:
        return Cmp("<=", lift(other, INT), self)


class Lit(Expr):
    __slots__ = ("value",)

    def __init__(self, value: int | bool | str, sort: Sort) -> None:
        self.value, self.sort = value, sort


class Var(Expr):
    """A bound variable or an action parameter."""

    __slots__ = ("name",)

    def __init__(self, name: str, sort: Sort) -> None:
        self.name, self.sort = name, sort

    def __call__(self, *args: Any) -> App:
        if self.sort.kind != "fn":
            raise TypeError(f"{self.name} is not a function parameter")
        return App(self, args)


class Const(Expr):
    """A configuration constant (rigid: no action changes it)."""

    __slots__ = ("name", "default")

    def __init__(self, name: str, sort: Sort, default: Any = None) -> None:
        # default: the value when a configuration does not mention the constant (features
        # added later, so that older configurations and traces keep their meaning)
        self.name, self.sort, self.default = name, sort, default


class StateFn:
    """A state function or relation (ret BOOL). `init` gives the initial value, None = any."""

    def __init__(self, name: str, args: tuple[Sort, ...], ret: Sort,
                 init: Callable[..., Any] | None, ghost: bool, doc: str) -> None:
        self.name, self.args, self.ret, self.ghost, self.doc = name, args, ret, ghost, doc
        self.init = init

    def __call__(self, *args: Any) -> App:
        return App(self, args)

    def post(self, *args: Any) -> App:
        """The value after the transition (transition invariants only)."""
        return App(self, args, post=True)

    def init_body(self) -> tuple[list[Var], Expr] | None:
        """The initial value as variables `_<name><i>` and an expression over them, or None."""
        if self.init is None:
            return None
        vs = [Var(f"_{self.name}{i}", a) for i, a in enumerate(self.args)]
        return vs, lift(self.init(*vs), self.ret)

    def __repr__(self) -> str:
        return self.name


class Op:
    """An interpreted operation on value sorts (uninterpreted in z3, see `atom_core.seq`)."""

    def __init__(self, name: str, args: tuple[Sort, ...], ret: Sort, doc: str) -> None:
        self.name, self.args, self.ret, self.doc = name, args, ret, doc

    def __call__(self, *args: Any) -> App:
        return App(self, args)

    def __repr__(self) -> str:
        return self.name


class App(Expr):
    __slots__ = ("fn", "args", "post")

    def __init__(self, fn: StateFn | Op | Var, args: Iterable[Any], post: bool = False) -> None:
        self.fn, self.post = fn, post
        arg_sorts = fn.sort.args if isinstance(fn, Var) else fn.args
        args = tuple(args)
        if len(args) != len(arg_sorts):
            raise TypeError(f"{fn!r} takes {len(arg_sorts)} arguments, got {len(args)}")
        self.args = tuple(lift(a, s) for a, s in zip(args, arg_sorts, strict=True))
        for a, s in zip(self.args, arg_sorts, strict=True):
            _check(a, s, f"argument of {fn!r}")
        self.sort = fn.sort.ret if isinstance(fn, Var) else fn.ret


class Ite(Expr):
    __slots__ = ("cond", "then", "other")

    def __init__(self, cond: Expr, then: Expr, other: Expr) -> None:
        self.cond = lift(cond, BOOL)
        _check(self.cond, BOOL, "ite condition")
        if not isinstance(then, Expr):
            then = lift(then, other.sort if isinstance(other, Expr) else INT)
        self.then = then
        self.other = lift(other, self.then.sort)
        _check(self.other, self.then.sort, "ite branch")
        self.sort = self.then.sort


class Not(Expr):
    __slots__ = ("arg",)

    def __init__(self, arg: Expr) -> None:
        self.arg, self.sort = arg, BOOL
        _check(arg, BOOL, "~")


class And(Expr):
    __slots__ = ("args",)

    def __init__(self, *args: Expr) -> None:
        self.args, self.sort = tuple(lift(a, BOOL) for a in args), BOOL
        for a in self.args:
            _check(a, BOOL, "&")


class Or(Expr):
    __slots__ = ("args",)

    def __init__(self, *args: Expr) -> None:
        self.args, self.sort = tuple(lift(a, BOOL) for a in args), BOOL
        for a in self.args:
            _check(a, BOOL, "|")


class Implies(Expr):
    __slots__ = ("hyp", "concl")

    def __init__(self, hyp: Expr, concl: Expr) -> None:
        self.hyp, self.concl, self.sort = lift(hyp, BOOL), lift(concl, BOOL), BOOL
        _check(self.hyp, BOOL, "implies")
        _check(self.concl, BOOL, "implies")


class Eq(Expr):
    __slots__ = ("lhs", "rhs")

    def __init__(self, lhs: Expr, rhs: Expr) -> None:
        self.lhs, self.rhs, self.sort = lhs, rhs, BOOL
        _check(rhs, lhs.sort, "==")


class Arith(Expr):
    __slots__ = ("op", "lhs", "rhs")

    def __init__(self, op: str, lhs: Expr, rhs: Expr) -> None:
        self.op, self.lhs, self.rhs, self.sort = op, lhs, rhs, INT
        _check(lhs, INT, op)
        _check(rhs, INT, op)


class Cmp(Expr):
    __slots__ = ("op", "lhs", "rhs")

    def __init__(self, op: str, lhs: Expr, rhs: Expr) -> None:
        self.op, self.lhs, self.rhs, self.sort = op, lhs, rhs, BOOL
        _check(lhs, INT, op)
        _check(rhs, INT, op)


class Quant(Expr):
    __slots__ = ("kind", "var", "body")

    def __init__(self, kind: str, var: Var, body: Expr) -> None:
        self.kind, self.var, self.body, self.sort = kind, var, lift(body, BOOL), BOOL
        _check(self.body, BOOL, kind)


class Count(Expr):
    """#{x | cond(x)} over an index sort (counting invariants, checked per size)."""

    __slots__ = ("var", "cond")

    def __init__(self, var: Var, cond: Expr) -> None:
        self.var, self.cond, self.sort = var, cond, INT


class Enabled(Expr):
    """`action`'s guard holds for the bound parameters and some value of the others."""

    __slots__ = ("action", "bindings")

    def __init__(self, action: Action, bindings: dict[str, Expr]) -> None:
        self.action, self.sort = action, BOOL
        known = {p.name: p for p in action.params}
        for k in bindings:
            if k not in known:
                raise TypeError(f"{action.name} has no parameter {k!r}")
        self.bindings = {k: lift(v, known[k].sort) for k, v in bindings.items()}


class Vector(Expr):
    """A value per index (e.g. the block each decode row writes); only effects use it."""

    __slots__ = ("var", "body")

    def __init__(self, var: Var, body: Expr) -> None:
        self.var, self.body, self.sort = var, body, body.sort


TRUE = Lit(True, BOOL)
FALSE = Lit(False, BOOL)


def children(e: Expr) -> tuple[Expr, ...]:
    """The subterms of `e` (a state function applied through a parameter: that parameter too;
    an enabled action: its bindings, not its guard)."""
    t = type(e)
    if t is Lit or t is Var or t is Const:
        return ()
    if t is App:
        return (e.fn, *e.args) if isinstance(e.fn, Var) else e.args
    if t is Ite:
        return (e.cond, e.then, e.other)
    if t is Not:
        return (e.arg,)
    if t is And or t is Or:
        return e.args
    if t is Implies:
        return (e.hyp, e.concl)
    if t is Eq or t is Arith or t is Cmp:
        return (e.lhs, e.rhs)
    if t is Quant or t is Vector:
        return (e.body,)
    if t is Count:
        return (e.cond,)
    if t is Enabled:
        return tuple(e.bindings.values())
    raise TypeError(f"unknown expression type {t.__name__}")


def lift(value: Any, sort: Sort) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, bool):
        return Lit(value, BOOL)
    if isinstance(value, int):
        return Lit(value, INT)
    raise TypeError(f"cannot use {value!r} as a {sort.name} term")


def _check(e: Expr, sort: Sort, where: str) -> None:
    if e.sort is not sort:
        raise TypeError(f"{where}: expected {sort.name}, got {e.sort.name}")


# --------------------------------------------------------------------------- helpers

_fresh = itertools.count()


def _bind(sorts: Sort | tuple[Sort, ...], fn: Callable[..., Any]) -> tuple[list[Var], Expr]:
    sorts = sorts if isinstance(sorts, tuple) else (sorts,)
    names = list(inspect.signature(fn).parameters)
    vs = [Var(f"{n}_{next(_fresh)}", s) for n, s in zip(names, sorts, strict=True)]
    return vs, fn(*vs)


def forall(sorts: Sort | tuple[Sort, ...], fn: Callable[..., Any]) -> Expr:
    vs, body = _bind(sorts, fn)
    out = lift(body, BOOL)
    for v in reversed(vs):
        out = Quant("forall", v, out)
    return out


def exists(sorts: Sort | tuple[Sort, ...], fn: Callable[..., Any]) -> Expr:
    vs, body = _bind(sorts, fn)
    out = lift(body, BOOL)
    for v in reversed(vs):
        out = Quant("exists", v, out)
    return out


def count(sort: Sort, fn: Callable[[Var], Any]) -> Expr:
    (v,), body = _bind(sort, fn)
    return Count(v, lift(body, BOOL))


def vector(sort: Sort, fn: Callable[[Var], Any]) -> Expr:
    (v,), body = _bind(sort, fn)
    return Vector(v, body)


def implies(hyp: Any, concl: Any) -> Expr:
    return Implies(hyp, concl)


def ite(cond: Any, then: Any, other: Any) -> Expr:
    return Ite(cond, then, other)


def one_of(e: Expr, *members: Expr) -> Expr:
    return Or(*(e == m for m in members))


def enabled(action: Action, **bindings: Any) -> Expr:
    return Enabled(action, bindings)


# --------------------------------------------------------------------------- model parts


class Update:
    """fn(args) := value, or fn := lambda var. value when `whole` (args are then the vars)."""

    __slots__ = ("fn", "args", "value", "whole")

    def __init__(self, fn: StateFn, args: tuple[Expr, ...], value: Expr, whole: bool) -> None:
        self.fn, self.args, self.value, self.whole = fn, args, value, whole


class Effect:
    """A runtime call the adapter performs after the transition (`copy`, `prefill`, ...)."""

    __slots__ = ("name", "args")

    def __init__(self, name: str, args: dict[str, Expr]) -> None:
        self.name, self.args = name, args


class Action:
    def __init__(self, name: str, params: list[Var], doc: str) -> None:
        self.name, self.params, self.doc = name, params, doc
        self.guards: list[tuple[str, Expr]] = []
        self.updates: list[Update] = []
        self.effects: list[Effect] = []
        # where the action can fire (see `live_when`): a claim about the guard that the proofs
        # check, not part of it
        self.live_when: Expr = TRUE

    def copy(self) -> Action:
        a = Action(self.name, list(self.params), self.doc)
        a.guards, a.updates, a.effects = list(self.guards), list(self.updates), list(self.effects)
        a.live_when = self.live_when
        return a

    def __repr__(self) -> str:
        return f"Action({self.name})"


class Definition:
    """A named predicate or term over the state (mypyvy's `definition`), e.g. `pinned(b)`.

    Calling it builds its body with the arguments substituted, so proofs and guards see exactly
    the expression the spec wrote (a definition is inlined where used: the z3 terms do not
    change). The generator also emits it as `core.<name>(s, *params)`, so the policy and the
    adapter ask the spec's question instead of re-deriving it."""

    def __init__(self, name: str, params: list[Var], body: Expr, build: Callable[..., Any],
                 doc: str) -> None:
        self.name, self.params, self.body, self.doc = name, params, body, doc
        self._build = build

    @property
    def sort(self) -> Sort:
        return self.body.sort

    def __call__(self, *args: Any) -> Expr:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        lifted = [lift(a, p.sort) for a, p in zip(args, self.params, strict=True)]
        for a, p in zip(lifted, self.params, strict=True):
            _check(a, p.sort, f"argument {p.name} of {self.name}")
        out = self._build(*lifted)
        return out if isinstance(out, Expr) else lift(out, self.body.sort)

    def __repr__(self) -> str:
        return self.name


class Named:
    """An invariant, transition invariant, progress property or axiom."""

    __slots__ = ("name", "expr", "kind", "doc", "live_when")

    def __init__(self, name: str, expr: Expr, kind: str, doc: str,
                 live_when: Expr | None = None) -> None:
        self.name, self.expr, self.kind, self.doc = name, expr, kind, doc
        # (progress properties: the configurations where the hypothesis can hold; see
        # `live_when`)
        self.live_when = TRUE if live_when is None else live_when


class Model:
    """Everything a spec declares, in declaration order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sorts: list[Sort] = []
        self.consts: list[Const] = []
        self.ops: list[Op] = []
        self.state: list[StateFn] = []
        self.actions: list[Action] = []
        self.axioms: list[Named] = []
        self.laws: list[Named] = []  # of the value operations (see `law`)
        self.invariants: list[Named] = []  # kind: relational | bounded
        self.safety_properties: list[str] = []  # the invariants that are the point (`safety`)
        self.transition_invariants: list[Named] = []
        self.progress: list[Named] = []
        self.definitions: list[Definition] = []
        self.lookups: list[StateFn] = []  # see `lookup`
        self._current: Action | None = None

    # declarations ----------------------------------------------------------
    def sort(self, s: Sort) -> Sort:
        self.sorts.append(s)
        return s

    def const(self, name: str, sort: Sort, default: Any = None) -> Const:
        c = Const(name, sort, default)
        self.consts.append(c)
        return c

    def op(self, name: str, args: list[Sort], ret: Sort, doc: str = "") -> Op:
        o = Op(name, tuple(args), ret, doc)
        self.ops.append(o)
        return o

    def fn(self, name: str, args: list[Sort], ret: Sort, init: Any = None,
           ghost: bool = False, doc: str = "") -> StateFn:
        if init is not None and not callable(init):
            value = init
            init = lambda *_: value  # noqa: E731 - a constant initial value
        f = StateFn(name, tuple(args), ret, init, ghost, doc)
        self.state.append(f)
        return f

    def lookup(self, f: StateFn) -> StateFn:
        """Declares that the layers above the core find the x with f(x) == v (e.g. the cache
        entries whose first chunk is a prompt's): the generator emits `core.where_<f>(s, v)`,
        the ascending such x, and the in-place core answers it from an index of f instead of a
        scan. A query only: the proofs do not see it. f: a non-ghost function of one index
        sort."""
        if f not in self.state or f.ghost or len(f.args) != 1 or f.args[0].kind != "index":
            raise TypeError(f"lookup {f.name}: needs a non-ghost state function of one index sort")
        if f in self.lookups:
            raise ValueError(f"lookup {f.name} declared twice")
        self.lookups.append(f)
        return f

    def axiom(self, name: str, expr: Expr, doc: str = "") -> None:
        self.axioms.append(Named(name, lift(expr, BOOL), "axiom", doc))

    def law(self, name: str, expr: Expr, doc: str = "") -> None:
        """A fact about the value operations (a sequence's length after `push`), quantified over
        values: assumed by the unbounded proofs only. Bounded queries stay quantifier-free
        (they assume the invariants proved with it instead), and the generated core implements
        the operations (`atom_core.seq`, tested against every law)."""
        self.laws.append(Named(name, lift(expr, BOOL), "law", doc))

    def invariant(self, name: str, expr: Expr, bounded: bool = False, arithmetic: bool = False,
                  doc: str = "") -> None:
        """Proved for all sizes (relational) unless: `arithmetic`, positions modulo the chunk
        or multiples of the block size, linear only once C and S are numbers: proved for all
        sizes at the chunk and block size the bounded checks fix; `bounded`, counting (which
        first-order logic over unbounded sorts cannot state): proved per size up to a cutoff."""
        if bounded and arithmetic:
            raise ValueError(f"invariant {name}: bounded or arithmetic, not both")
        kind = "bounded" if bounded else "arithmetic" if arithmetic else "relational"
        self.invariants.append(Named(name, lift(expr, BOOL), kind, doc))

    def safety(self, name: str, expr: Expr, doc: str = "") -> None:
        """A relational invariant that is the point (no block in two tables, a cache key is its
        content, ...), as opposed to one that only helps prove the others."""
        self.invariant(name, expr, doc=doc)
        self.safety_properties.append(name)

    def transition_invariant(self, name: str, expr: Expr, doc: str = "") -> None:
        self.transition_invariants.append(Named(name, lift(expr, BOOL), "transition", doc))

    def progress_property(self, name: str, expr: Expr, doc: str = "",
                          live_when: Any = True) -> None:
        """`live_when`: the configurations (an expression over constants) where the property's
        hypothesis can hold; it must be unsatisfiable in every other (see `live_when`)."""
        cond = _constant_condition(live_when, f"progress property {name}: live_when")
        self.progress.append(Named(name, lift(expr, BOOL), "progress", doc, cond))

    def definition(self, fn: Callable[..., Any]) -> Definition:
        """Decorator: a named predicate (or term) over the state; the function's annotated
        parameters are its parameters, its body returns the expression. Using it inlines the
        body (proofs see the same terms); the generator emits `core.<name>(s, ...)`."""
        sig = inspect.signature(fn)
        for n, p in sig.parameters.items():
            if not isinstance(p.annotation, Sort):
                raise TypeError(f"definition {fn.__name__}: parameter {n} needs a sort annotation")
        params = [Var(n, p.annotation) for n, p in sig.parameters.items()]
        body = fn(*params)
        body = body if isinstance(body, Expr) else lift(body, BOOL)
        d = Definition(fn.__name__, params, body, fn, inspect.getdoc(fn) or "")
        if any(x.name == d.name for x in self.definitions):
            raise ValueError(f"definition {d.name} is declared twice")
        self.definitions.append(d)
        return d

    # actions -----------------------------------------------------------------
    def action(self, fn: Callable[..., None]) -> Action:
        """Decorator: the function's annotated parameters are the action's choice parameters;
        its body calls require / assign / assign_all / emit."""
        sig = inspect.signature(fn)
        params = [Var(n, p.annotation) for n, p in sig.parameters.items()]
        act = Action(fn.__name__, params, inspect.getdoc(fn) or "")
        self._current = act
        try:
            fn(*params)
        finally:
            self._current = None
        self.actions.append(act)
        return act

    def _act(self) -> Action:
        if self._current is None:
            raise RuntimeError("require/assign/emit are only valid inside @model.action")
        return self._current

    # lookups -------------------------------------------------------------------
    def get_action(self, name: str) -> Action:
        for a in self.actions:
            if a.name == name:
                return a
        raise KeyError(f"no action {name!r}")

    def copy(self) -> Model:
        m = Model(self.name)
        m.sorts, m.consts, m.ops, m.state = (list(self.sorts), list(self.consts),
                                             list(self.ops), list(self.state))
        m.actions = [a.copy() for a in self.actions]
        m.axioms, m.invariants = list(self.axioms), list(self.invariants)
        m.laws = list(self.laws)
        m.safety_properties = list(self.safety_properties)
        m.definitions, m.lookups = list(self.definitions), list(self.lookups)
        m.transition_invariants, m.progress = (list(self.transition_invariants),
                                               list(self.progress))
        return m

    # mutants (planted bugs): copies with one piece changed ------------------
    def without_guard(self, action: str, guard: str) -> Model:
        m = self.copy()
        a = m.get_action(action)
        if guard not in [g for g, _ in a.guards]:
            raise KeyError(f"{action} has no guard {guard!r}")
        a.guards = [(g, e) for g, e in a.guards if g != guard]
        return m

    def with_guard(self, action: str, guard: str, expr: Expr) -> Model:
        m = self.copy()
        a = m.get_action(action)
        a.guards = [(g, expr if g == guard else e) for g, e in a.guards]
        return m

    def without_update(self, action: str, fn: str) -> Model:
        m = self.copy()
        a = m.get_action(action)
        if fn not in [u.fn.name for u in a.updates]:
            raise KeyError(f"{action} does not update {fn!r}")
        a.updates = [u for u in a.updates if u.fn.name != fn]
        return m


_MODEL: list[Model] = []


def use_model(m: Model) -> None:
    """Make `m` the target of require/assign/emit (set by the spec module)."""
    _MODEL[:] = [m]


def require(name: str, cond: Any) -> None:
    """A named guard conjunct: the action is allowed only when it holds."""
    _MODEL[0]._act().guards.append((name, lift(cond, BOOL)))


def live_when(cond: Any) -> None:
    """Where the action can fire: the configurations (an expression over constants only, e.g.
    `HOST`, `T > 1`) in which its guard is satisfiable; in every other it must be dead.
    Without it, the action must be able to fire in every configuration. A claim about the
    guard, not part of it: `verify` checks it both ways (proofs/nonvacuity.py), so a guard made
    dead where the action should fire, or left live where it cannot, fails."""
    act = _MODEL[0]._act()
    cond = _constant_condition(cond, f"action {act.name}: live_when")
    act.live_when = cond if act.live_when is TRUE else And(act.live_when, cond)


def _constant_condition(cond: Any, what: str) -> Expr:
    e = lift(cond, BOOL)
    if not reads_only_constants(e):
        raise TypeError(f"{what} must read only configuration constants (e.g. HOST, T > 1), "
                        f"not the state, a parameter or a bound variable")
    return e


def show(e: Expr) -> str:
    """A condition over constants as the spec writes it (`PREFIX & (T > 1)`), for messages."""
    if isinstance(e, Const):
        return e.name
    if isinstance(e, Lit):
        return str(e.value)
    if isinstance(e, Not):
        return f"~{_wrap(e.arg)}"
    if isinstance(e, (And, Or)):
        return f" {'&' if isinstance(e, And) else '|'} ".join(_wrap(a) for a in e.args)
    if isinstance(e, Eq):
        return f"{_wrap(e.lhs)} == {_wrap(e.rhs)}"
    if isinstance(e, (Arith, Cmp)):
        return f"{_wrap(e.lhs)} {e.op} {_wrap(e.rhs)}"
    return type(e).__name__


def _wrap(e: Expr) -> str:
    return show(e) if isinstance(e, (Const, Lit, Not)) else f"({show(e)})"


def reads_only_constants(e: Expr) -> bool:
    """Whether `e` reads nothing but configuration constants (no state, parameter or bound
    variable): a feature gate."""
    stack: list[Any] = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, (Var, Enabled, Quant, Count)) or (
                isinstance(x, App) and not isinstance(x.fn, Op)):
            return False
        stack.extend(children(x))
    return True


def assign(target: App, value: Any) -> None:
    """fn(args) := value, evaluated in the pre-state."""
    if not isinstance(target, App) or not isinstance(target.fn, StateFn) or target.post:
        raise TypeError("assign() needs a state function application, e.g. owner(b)")
    v = value if isinstance(value, Expr) else lift(value, target.sort)
    _check(v, target.sort, f"assign to {target.fn.name}")
    _MODEL[0]._act().updates.append(Update(target.fn, target.args, v, whole=False))


def assign_all(fn: StateFn, body: Callable[..., Any]) -> None:
    """fn := lambda args. body(args), evaluated in the pre-state."""
    vs, value = _bind(fn.args, body)
    v = value if isinstance(value, Expr) else lift(value, fn.ret)
    _check(v, fn.ret, f"assign_all to {fn.name}")
    _MODEL[0]._act().updates.append(Update(fn, tuple(vs), v, whole=True))


def emit(name: str, **args: Any) -> None:
    """Record a runtime effect (the adapter executes it)."""
    _MODEL[0]._act().effects.append(
        Effect(name, {k: v if isinstance(v, Expr) else lift(v, INT) for k, v in args.items()}))
