"""The expression compiler: `Body` is one generated function (its lines, lazily defined
locals, shared subterms and bound-variable names) and prints `atom_core.spec.lang`
expressions as Python at a given precedence (`TERN` ... `ATOM`)."""

from __future__ import annotations

import keyword
import re
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from atom_core.spec.codegen.analysis import GenerationError, Memo, binder, canon, child_flags, walk
from atom_core.spec.codegen.printer import (
    SPACE,
    WIDTH,
    Group,
    bracket,
    call_doc,
    genexpr,
    join,
    render,
    tabulate_doc,
)
from atom_core.spec.lang import (
    And,
    App,
    Arith,
    Cmp,
    Const,
    Count,
    Enabled,
    Eq,
    Expr,
    Implies,
    Ite,
    Lit,
    Not,
    Op,
    Or,
    Quant,
    Sort,
    StateFn,
    Var,
    Vector,
)

if TYPE_CHECKING:
    from atom_core.spec.codegen.pure import Generator


# --------------------------------------------------------------------------- expressions

# Python precedence, loosest first. Every conditional expression is printed in parentheses.
TERN, OR, AND, NOT, CMP, ADD, MUL, UNARY, ATOM = range(1, 10)
_ARITH_PREC = {"+": ADD, "-": ADD, "*": MUL, "%": MUL}
_FLIP = {"<": ">", "<=": ">="}
_NEG = {"<": ">=", "<=": ">"}
_NEG_FLIPPED = {"<": "<=", "<=": "<"}
BUILTINS = frozenset(
    "all any bool dict int len list max min range set sorted str sum tuple".split())


def base_name(v: Var) -> str:
    base = re.sub(r"_\d+$", "", v.name)
    return base if base.isidentifier() and not keyword.iskeyword(base) else "x"


# --------------------------------------------------------------------------- function bodies


class Body:
    """One generated function: its lines, locals, shared subterms and bound-variable names.

    `states` maps False (pre) / True (post) to the name of the State parameter; `consts` is the
    expression of the Consts object. Prerequisite locals (fields, constants, memos, ident
    domains) are defined lazily, right before the first statement that needs them.
    """

    def __init__(self, gen: Generator, *, params: list[Var], consts: str,
                 states: dict[bool, str], mode: str, local_names: str, indent: int = 4,
                 counts: dict[tuple[Any, ...], int] | None = None) -> None:
        self.gen, self.an = gen, gen.an
        self.params = params
        self.param_ids = {id(p) for p in params}
        self.consts, self.states, self.mode = consts, states, mode
        self.lines: list[str] = []
        self.indent = indent
        self.counts = counts  # None: first (counting) pass
        self.use_count: dict[tuple[Any, ...], int] = {}
        self.scopes: list[set[tuple[Any, ...]]] = [set()]
        self.pending: list[tuple[Any, ...]] = []
        self.defs: dict[tuple[Any, ...], tuple[Any, list[tuple[Any, ...]]]] = {}
        self.memos: list[Memo] = []
        self.memo_occ: dict[int, tuple[Memo, Var | None]] = {}
        self.loop_depth = 0
        pnames = [p.name for p in params]
        self.reserved = set(gen.module_names) | BUILTINS | set(local_names.split()) | set(pnames)
        self.field_local: dict[tuple[str, bool], str] = {}
        for f in gen.model.state:
            for post, st in states.items():
                name = f.name if len(states) == 1 else f"{st}_{f.name}"
                if name in pnames:
                    name = f"{st}_{f.name}"
                self.field_local[(f.name, post)] = name
                self.reserved.add(name)
            self.reserved.add(f"new_{f.name}")
        for c in gen.model.consts:
            self.reserved.add(c.name if c.name not in pnames else f"c_{c.name}")
        for s in gen.model.sorts:
            if s.kind == "ident":
                self.reserved.add(self._ids_local(s))
        self.env0 = {id(p): p.name for p in params}

    # -- output --------------------------------------------------------------------------
    def line(self, doc: Any) -> None:
        self.lines.append(" " * self.indent + render(doc, self.indent))

    def comment(self, text: str) -> None:
        width = WIDTH - self.indent - 2
        for chunk in textwrap.wrap(text, width) or [""]:
            self.lines.append(" " * self.indent + "# " + chunk)

    @contextmanager
    def block(self, header: str) -> Iterator[None]:
        self.flush()
        self.line(header)
        self.indent += 4
        self.scopes.append(set())
        try:
            yield
        finally:
            self.flush()
            self.scopes.pop()
            self.indent -= 4

    def stmt(self, doc: Any, comment: str = "") -> None:
        self.flush()
        if comment:
            self.comment(comment)
        self.line(doc)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for key in pending:
            self._define(key)

    def _defined(self, key: tuple[Any, ...]) -> bool:
        return any(key in sc for sc in self.scopes)

    def _define(self, key: tuple[Any, ...]) -> None:
        if self._defined(key):
            return
        doc, deps = self._definition(key)
        for d in deps:
            self._define(d)
        self.line(doc)
        self.scopes[-1].add(key)

    def _definition(self, key: tuple[Any, ...]) -> tuple[Any, list[tuple[Any, ...]]]:
        hit = self.defs.get(key)
        if hit is not None:
            return hit
        saved, self.pending = self.pending, []
        kind = key[0]
        if kind == "field":
            _, fname, post = key
            doc: Any = f"{self.field_local[(fname, post)]} = {self.states[post]}.{fname}"
        elif kind == "const":
            doc = f"{self._const_local(key[1])} = {self.consts}.{key[1]}"
        elif kind == "ids":
            sort = self.gen.sort_by_name[key[1]]
            states = ", ".join(self.states[p] for p in sorted(self.states))
            doc = f"{self._ids_local(sort)} = _{sort.name.lower()}_ids({states})"
        else:  # memo
            m = self.memos[key[1]]
            doc = self.gen._assign(m.name, self._memo_value(m))
        deps, self.pending = self.pending, saved
        self.defs[key] = (doc, deps)
        return doc, deps

    def _use(self, key: tuple[Any, ...], local: str, inline: str | None) -> str:
        self.use_count[key] = self.use_count.get(key, 0) + (2 if self.loop_depth else 1)
        if inline is not None and self.counts is not None and self.counts.get(key, 0) <= 1:
            if not self._defined(key):
                return inline
        if key not in self.pending:
            self.pending.append(key)
        return local

    def _const_local(self, name: str) -> str:
        return name if name not in (p.name for p in self.params) else f"c_{name}"

    @staticmethod
    def _ids_local(sort: Sort) -> str:
        return f"{sort.name.lower()}_ids"

    def field(self, fn: StateFn, post: bool) -> str:
        if post not in self.states:
            raise GenerationError(
                f"{fn.name}.post is only allowed in transition invariants" if post
                else f"{fn.name} is read where there is no state")
        return self._use(("field", fn.name, post), self.field_local[(fn.name, post)],
                         f"{self.states[post]}.{fn.name}")

    def const(self, name: str) -> str:
        return self._use(("const", name), self._const_local(name), f"{self.consts}.{name}")

    def size(self, sort: Sort) -> str:
        if sort.size not in self.gen.const_names:
            raise GenerationError(f"index sort {sort.name}: size {sort.size!r} is not a const")
        return self.const(sort.size)

    # -- shared subterms -----------------------------------------------------------------
    def _qualify(self, e: Expr) -> tuple[tuple[Any, ...], Var | None, bool] | None:
        """(key, hole, total) when `e` may be shared, else None."""
        t = type(e)
        if t is Lit or t is Var or t is Const:
            return None
        free = [v for v in self.an.free(e) if id(v) not in self.param_ids]
        if len(free) > 1 or (free and free[0].sort.kind != "index"):
            return None
        if any(type(x) is Enabled or type(x) is Vector for x in walk(e)):
            return None
        total = self.an.total(e)
        if free:  # tabulated over the whole sort: must be total, and worth it
            if not total or not self.an.costly(e):
                return None
            return canon(e, free[0], {}), free[0], True
        if not self.an.costly(e) and self.an.size(e) < 4:
            return None
        return canon(e, None, {}), None, total

    def select_memos(self, *groups: list[tuple[Expr, tuple[Var, ...]]]) -> None:
        """Choose shared subterms over the statements' roots (in emission order), group by
        group: non-ghost statements first, so ghost-only sharing never costs the ghost-free
        path. Largest first; a subterm inside a chosen one counts once per definition.

        A tabulated memo (one bound variable) must be total and occur twice. A closed one must
        occur twice or sit inside a loop; if it may raise (a sequence op, `%`), every occurrence
        must be unconditional in its statement (not behind and/or/implies/ite/a quantifier), so
        evaluating it right before the statement raises exactly when the statement would.
        """
        qual: dict[int, tuple[tuple[Any, ...], Var | None, bool] | None] = {}

        def q(e: Expr) -> tuple[tuple[Any, ...], Var | None, bool] | None:
            if id(e) not in qual:
                qual[id(e)] = self._qualify(e)
            return qual[id(e)]

        selected: dict[tuple[Any, ...], Memo] = {}

        def scan(roots: list[tuple[Expr, tuple[Var, ...]]], record: bool) -> dict[Any, Any]:
            seen: dict[tuple[Any, ...], list[Any]] = {}
            # (node, inside a loop, evaluated whenever its statement is, may be shared)
            todo = [(m.node, m.hole is not None, True, False) for m in reversed(selected.values())]
            todo += [(e, len(bs) > 0, True, True) for e, bs in reversed(roots)]
            while todo:
                e, in_loop, uncond, can_memo = todo.pop()
                k = q(e) if can_memo else None
                if k is not None:
                    key, hole, total = k
                    if key in selected:
                        if record:
                            self.memo_occ[id(e)] = (selected[key], hole)
                        continue
                    entry = seen.setdefault(key, [e, hole, 0, False, True, total])
                    entry[2] += 1
                    entry[3] = entry[3] or in_loop
                    entry[4] = entry[4] and uncond
                loops = in_loop or binder(e) is not None
                todo.extend((c, loops, uncond and f, True)
                            for c, f in reversed(child_flags(e)))
            return seen

        roots_so_far: list[tuple[Expr, tuple[Var, ...]]] = []
        for group in groups:
            roots_so_far = roots_so_far + list(group)
            while True:
                seen = scan(roots_so_far, record=False)
                best = None
                for key, (node, hole, n, in_loop, uncond, total) in seen.items():
                    if hole is not None:
                        ok = n >= 2
                    else:
                        ok = (n >= 2 or in_loop) and (total or uncond)
                    if ok and (best is None or self.an.size(node) > self.an.size(best[1])):
                        best = (key, node, hole)
                if best is None:
                    break
                key, node, hole = best
                m = Memo("", node, hole, key)
                self.memos.append(m)
                selected[key] = m
        self.memo_occ.clear()
        scan(roots_so_far, record=True)

    def _memo_name(self, m: Memo) -> str:
        """Memos are numbered in the order the function first mentions them."""
        if not m.name:
            m.name = f"_m{sum(1 for x in self.memos if x.name)}"
        return m.name

    def _memo_value(self, m: Memo) -> tuple[Any, int]:
        if m.hole is None:
            return self.expr(m.node, self.env0, memo_root=True)
        name = self.fresh(base_name(m.hole), self.env0)
        env = dict(self.env0)
        env[id(m.hole)] = name
        self.loop_depth += 1
        body = self.expr(m.node, env, memo_root=True)[0]
        self.loop_depth -= 1
        loop = f"for {name} in range({self.size(m.hole.sort)})"
        return tabulate_doc(body, [loop]), ATOM

    # -- names ---------------------------------------------------------------------------
    def fresh(self, base: str, env: dict[int, str]) -> str:
        taken = set(env.values())
        name, k = base, 1
        while name in self.reserved or name in taken or name.startswith("_m"):
            k += 1
            name = f"{base}{k}"
        return name

    # -- expressions ---------------------------------------------------------------------
    def top(self, e: Expr) -> tuple[Any, int]:
        return self.expr(e, self.env0)

    def expr(self, e: Expr, env: dict[int, str], memo_root: bool = False) -> tuple[Any, int]:
        if not memo_root:
            occ = self.memo_occ.get(id(e))
            if occ is not None:
                return self._memo_use(occ, env), ATOM
        meth = getattr(self, "_p_" + type(e).__name__, None)
        if meth is None:
            raise GenerationError(f"codegen does not know the expression type {type(e).__name__}")
        return meth(e, env)

    def _memo_use(self, occ: tuple[Memo, Var | None], env: dict[int, str]) -> str:
        m, hole = occ
        name = self._use(("memo", self.memos.index(m)), self._memo_name(m), None)
        if hole is None:
            return name
        return f"{name}[{self._var(hole, env)}]"

    def _at(self, e: Expr, env: dict[int, str], prec: int) -> Any:
        """`e` printed so that it binds at least as tightly as `prec`."""
        doc, p = self.expr(e, env)
        return doc if p >= prec else bracket("(", doc, ")")

    def _var(self, v: Var, env: dict[int, str]) -> str:
        name = env.get(id(v))
        if name is None:
            raise GenerationError(f"variable {v.name!r} is not bound here")
        return name

    def _p_Lit(self, e: Lit, env: dict[int, str]) -> tuple[Any, int]:
        v = e.value
        if isinstance(v, bool):
            return ("True" if v else "False"), ATOM
        if isinstance(v, str):
            if e.sort.kind != "enum" or v not in e.sort.values:
                raise GenerationError(f"literal {v!r} of sort {e.sort.name}")
            return self.gen.enum_const(e.sort, v), ATOM
        if isinstance(v, int):
            return str(v), (UNARY if v < 0 else ATOM)
        raise GenerationError(f"literal {v!r} has no Python form")

    def _p_Var(self, e: Var, env: dict[int, str]) -> tuple[Any, int]:
        return self._var(e, env), ATOM

    def _p_Const(self, e: Const, env: dict[int, str]) -> tuple[Any, int]:
        return self.const(e.name), ATOM

    def _p_App(self, e: App, env: dict[int, str]) -> tuple[Any, int]:
        fn = e.fn
        args = [self.expr(a, env)[0] for a in e.args]
        if isinstance(fn, Op):
            return call_doc(fn.name, args), ATOM
        if isinstance(fn, Var):
            return [self._var(fn, env), *(["[", a, "]"] for a in args)], ATOM
        if e.post and "post" not in self.mode:
            raise GenerationError(f"{fn.name}.post is only allowed in transition invariants")
        f = self.field(fn, e.post)
        layout = self.gen.layout(fn)
        if layout == "scalar":
            return f, ATOM
        if layout == "map":
            return call_doc(f + ".get", args + self.gen.map_default(fn)), ATOM
        return [f, *(["[", a, "]"] for a in args)], ATOM

    def _p_Ite(self, e: Ite, env: dict[int, str]) -> tuple[Any, int]:
        if type(e.cond) is Lit and isinstance(e.cond.value, bool):
            return self.expr(e.then if e.cond.value else e.other, env)
        then = self._at(e.then, env, NOT)
        cond = self._at(e.cond, env, NOT)
        other = self._at(e.other, env, NOT)
        inner = [then, SPACE, "if ", cond, SPACE, "else ", other]
        return bracket("(", inner, ")"), ATOM

    def _p_Not(self, e: Not, env: dict[int, str]) -> tuple[Any, int]:
        return self.neg(e.arg, env)

    def neg(self, e: Expr, env: dict[int, str]) -> tuple[Any, int]:
        """The negation of boolean `e`, pushed through one level where that reads better."""
        t = type(e)
        if id(e) not in self.memo_occ:
            if t is Not:
                return self.expr(e.arg, env)
            if t is Lit and isinstance(e.value, bool):
                return ("False" if e.value else "True"), ATOM
            if t is Eq:
                simple = self._eq_bool(e, env, negate=True)
                if simple is not None:
                    return simple
                return self._binop(e.lhs, "!=", e.rhs, env), CMP
            if t is Cmp:
                if self._flip(e):
                    return self._binop(e.rhs, _NEG_FLIPPED[e.op], e.lhs, env), CMP
                return self._binop(e.lhs, _NEG[e.op], e.rhs, env), CMP
            if t is Implies:
                parts = [self.expr(x, env) for x in self._flatten(And, [e.hyp])]
                return self._chain("and", parts + [self.neg(e.concl, env)])
            if t is Enabled:
                text, prec = self._p_Enabled(e, env)
                if prec == CMP:  # one guard call: `... is None` reads `... is not None`
                    return [*text[:-1], " is not None"], CMP
        return ["not ", self._at(e, env, NOT)], NOT

    def _eq_bool(self, e: Eq, env: dict[int, str], negate: bool) -> tuple[Any, int] | None:
        for a, b in ((e.lhs, e.rhs), (e.rhs, e.lhs)):
            if type(b) is Lit and isinstance(b.value, bool):
                return self.neg(a, env) if b.value == negate else self.expr(a, env)
        return None

    @staticmethod
    def _flip(e: Cmp) -> bool:
        """Print `0 < x` as `x > 0` (the DSL turns `x > 0` into `0 < x`)."""
        return type(e.lhs) is Lit or (type(e.lhs) is Const and type(e.rhs) not in (Lit, Const))

    def _binop(self, lhs: Expr, op: str, rhs: Expr, env: dict[int, str]) -> list[Any]:
        return [self._at(lhs, env, CMP + 1), f" {op} ", self._at(rhs, env, CMP + 1)]

    def _flatten(self, cls: type, items: list[Expr]) -> list[Expr]:
        out: list[Expr] = []
        for x in items:
            if type(x) is cls and id(x) not in self.memo_occ:
                out.extend(self._flatten(cls, list(x.args)))
            elif not (type(x) is Lit and x.value is (cls is And)):  # drop neutral elements
                out.append(x)
        return out

    @staticmethod
    def _chain(op: str, parts: list[tuple[Any, int]]) -> tuple[Any, int]:
        prec = AND if op == "and" else OR
        if not parts:
            return ("True" if op == "and" else "False"), ATOM
        if len(parts) == 1:
            return parts[0]
        # An `and` inside an `or` gets parentheses too, for the reader.
        docs = [d if p > AND or (p == AND and op == "and") else bracket("(", d, ")")
                for d, p in parts]
        return Group(join(docs, [SPACE, f"{op} "])), prec

    def _p_And(self, e: And, env: dict[int, str]) -> tuple[Any, int]:
        return self._chain("and", [self.expr(x, env) for x in self._flatten(And, list(e.args))])

    def _p_Or(self, e: Or, env: dict[int, str]) -> tuple[Any, int]:
        return self._chain("or", [self.expr(x, env) for x in self._flatten(Or, list(e.args))])

    def _p_Implies(self, e: Implies, env: dict[int, str]) -> tuple[Any, int]:
        concl = [self.expr(x, env) for x in self._flatten(Or, [e.concl])]
        if _is_true(e.hyp):
            return self._chain("or", concl)
        return self._chain("or", [self.neg(e.hyp, env)] + concl)

    def _p_Eq(self, e: Eq, env: dict[int, str]) -> tuple[Any, int]:
        simple = self._eq_bool(e, env, negate=False)
        if simple is not None:
            return simple
        return self._binop(e.lhs, "==", e.rhs, env), CMP

    def _p_Arith(self, e: Arith, env: dict[int, str]) -> tuple[Any, int]:
        prec = _ARITH_PREC.get(e.op)
        if prec is None:
            raise GenerationError(f"arithmetic operator {e.op!r}")
        return [self._at(e.lhs, env, prec), f" {e.op} ", self._at(e.rhs, env, prec + 1)], prec

    def _p_Cmp(self, e: Cmp, env: dict[int, str]) -> tuple[Any, int]:
        if e.op not in _FLIP:
            raise GenerationError(f"comparison {e.op!r}")
        if self._flip(e):
            return self._binop(e.rhs, _FLIP[e.op], e.lhs, env), CMP
        return self._binop(e.lhs, e.op, e.rhs, env), CMP

    def domain(self, sort: Sort) -> str:
        if sort.kind == "index":
            return f"range({self.size(sort)})"
        if sort.kind == "bool":
            return "(False, True)"
        if sort.kind == "enum":
            return f"range(len({sort.name.upper()}_NAMES))"
        if sort.kind == "ident":
            if "checker" not in self.mode:
                raise GenerationError(
                    f"a quantifier over ident sort {sort.name} is only allowed in invariants "
                    "and progress properties")
            key = ("ids", sort.name)
            return self._use(key, self._ids_local(sort), None)
        raise GenerationError(f"cannot quantify over {sort.name} ({sort.kind})")

    def _loop(self, fn: str, body_of: Callable[[dict[int, str]], Any], binds: list[Var],
              env: dict[int, str], cond: Callable[[dict[int, str]], Any] | None = None) -> Any:
        inner = dict(env)
        fors: list[Any] = []
        for v in binds:
            d = self.domain(v.sort)
            name = self.fresh(base_name(v), inner)
            inner[id(v)] = name
            fors.append(f"for {name} in {d}")
        self.loop_depth += 1
        body = body_of(inner)
        if cond is not None:
            fors.append(["if ", cond(inner)])
        self.loop_depth -= 1
        return tabulate_doc(body, fors) if fn == "tuple" else genexpr(fn, body, fors)

    def _whole_memo(self, body: Expr, v: Var) -> str | None:
        """`body` is a tabulated memo read at `v` itself: the memo is the whole tuple."""
        occ = self.memo_occ.get(id(body))
        if occ is not None and occ[1] is v:
            return self._use(("memo", self.memos.index(occ[0])), self._memo_name(occ[0]), None)
        return None

    def _p_Quant(self, e: Quant, env: dict[int, str]) -> tuple[Any, int]:
        fn = "all" if e.kind == "forall" else "any"
        if e.kind not in ("forall", "exists"):
            raise GenerationError(f"quantifier {e.kind!r}")
        whole = self._whole_memo(e.body, e.var)
        if whole is not None:
            return f"{fn}({whole})", ATOM
        if type(e.body) is Not and id(e.body) not in self.memo_occ:
            whole = self._whole_memo(e.body.arg, e.var)
            if whole is not None:
                return f"not {'any' if fn == 'all' else 'all'}({whole})", NOT
        binds = [e.var]
        body = e.body
        while type(body) is Quant and body.kind == e.kind and id(body) not in self.memo_occ:
            binds.append(body.var)
            body = body.body
        return self._loop(fn, lambda inner: self._at(body, inner, OR), binds, env), ATOM

    def _p_Count(self, e: Count, env: dict[int, str]) -> tuple[Any, int]:
        whole = self._whole_memo(e.cond, e.var)
        if whole is not None:
            return f"sum({whole})", ATOM
        return self._loop("sum", lambda inner: "1", [e.var], env,
                          cond=lambda inner: self._at(e.cond, inner, OR)), ATOM

    def _p_Vector(self, e: Vector, env: dict[int, str]) -> tuple[Any, int]:
        if "effect" not in self.mode:
            raise GenerationError("vector(...) is only allowed in effect arguments")
        if e.var.sort.kind != "index":
            raise GenerationError(f"vector over {e.var.sort.name}: needs an index sort")
        whole = self._whole_memo(e.body, e.var)
        if whole is not None:
            return whole, ATOM
        return self._loop("tuple", lambda inner: self._at(e.body, inner, OR), [e.var], env), ATOM

    def _p_Enabled(self, e: Enabled, env: dict[int, str]) -> tuple[Any, int]:
        if "progress" not in self.mode:
            raise GenerationError("enabled(...) is only allowed in progress properties")
        act = self.gen.model.get_action(e.action.name)
        read = self.gen.guard_params(act)
        args: list[Any] = []
        loops: list[tuple[str, str]] = []
        taken = dict(env)
        for p in act.params:
            if p.name in e.bindings:
                args.append(self._at(e.bindings[p.name], env, TERN))
            elif p.name not in read:
                args.append(self.gen.neutral_arg(p.sort, self))
            elif p.sort.kind in ("index", "bool", "enum"):
                name = self.fresh(p.name, taken)
                taken[id(p)] = name
                loops.append((name, self.domain(p.sort)))
                args.append(name)
            else:
                raise GenerationError(
                    f"enabled({act.name}): unbound parameter {p.name} ({p.sort.name}) is read "
                    "by the guard and cannot be enumerated; bind it")
        state = self.states[False]
        call = [call_doc(f"{act.name}_guard", [state, *args]), " is None"]
        if not loops:
            return call, CMP
        return genexpr("any", call, [f"for {n} in {d}" for n, d in loops]), ATOM


def _is_true(e: Expr) -> bool:
    return type(e) is Lit and e.value is True
