"""`GuardEmitter`: the read-only functions of the core (definitions, `where_<f>`, and per
action its guard, plan, `enabled_` and `ready_`): their headers and a guard's compilation
into statements (checks, `if`s, `for` loops with an early exit)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from atom_core.spec.codegen.analysis import reads_param
from atom_core.spec.codegen.base import GeneratorBase, py_type
from atom_core.spec.codegen.body import TERN, Body, base_name
from atom_core.spec.codegen.printer import WIDTH, call_doc, genexpr, render, tuple_doc
from atom_core.spec.lang import And, Expr, Implies, Ite, Lit, Not, Or, Quant, StateFn


class GuardEmitter(GeneratorBase):
    """Emits the read-only functions, which the in-place core shares with core.py when
    their text is the same (`readonly`, `_emit_fn`)."""

    def _signature(self, name: str, a: Any) -> str:
        # A guard's (or plan's) parameter that it never reads may be None (`enabled_*` and the
        # batcher pass an unbound one): Any, so that a compiled core does not check its type.
        if name == f"{a.name}_guard":
            read = {p.name for _, e in a.guards for p in a.params if reads_param(e, p)}
        elif name == f"{a.name}_plan":  # (the same for a plan: its guards and its effects)
            exprs = [e for _, e in a.guards] + [v for eff in a.effects for v in eff.args.values()]
            read = {p.name for e in exprs for p in a.params if reads_param(e, p)}
        else:
            read = {p.name for p in a.params}
        return ", ".join([f"s: {self.state_type(name)}"] + [
            f"{p.name}: {py_type(p.sort) if p.name in read else 'Any'}" for p in a.params])

    @staticmethod
    def _range_checks(a: Any, none_ok: bool = False) -> str:
        """Each index parameter within its sort (`_bad_index`); `none_ok`: a plan's parameter
        may be None."""
        out = []
        for p in a.params:
            if p.sort.kind != "index":
                continue
            size = f"s.consts.{p.sort.size}"
            skip = f"{p.name} is not None and " if none_ok else ""
            out.append(f"    if {skip}not 0 <= {p.name} < {size}:\n"
                       f'        raise _bad_index("{a.name}", "{p.name}", {p.name}, '
                       f'"{p.sort.name}", {size})\n')
        return "".join(out)

    def _def(self, name: str, a: Any, ret: str) -> str:
        """A function header, its parameters on a line of their own when it is too long."""
        line = f"def {name}({self._signature(name, a)}) -> {ret}:\n"
        if len(line) <= WIDTH + 1:
            return line
        return f"def {name}(\n    {self._signature(name, a)},\n) -> {ret}:\n"

    def readonly(self) -> dict[str, Callable[[], str]]:
        """Every read-only function (name -> its emitter), in module order: the definitions,
        then per action its guard, plan (when it has effects), `enabled_` and `ready_`."""
        out: dict[str, Callable[[], str]] = {}
        for d in self.model.definitions:
            out[d.name] = lambda d=d: self._definition_fn(d)
        for f in self.model.lookups:
            out[f"where_{f.name}"] = lambda f=f: self._where_fn(f)
        for a in self.model.actions:
            out[f"{a.name}_guard"] = lambda a=a: self._guard_fn(a)
            if a.effects:
                out[f"{a.name}_plan"] = lambda a=a: self._plan_fn(a)
            out[f"enabled_{a.name}"] = lambda a=a: self._enabled_fn(a)
            out[f"ready_{a.name}"] = lambda a=a: self._ready_fn(a)
        return out

    def _emit_fn(self, name: str, build: Callable[[], str]) -> str:
        """The text of the module's function `name` (the in-place core caches it, and omits a
        function it imports from core.py)."""
        return build()

    def _definitions(self) -> str:
        """`core.<name>(s, ...)` per spec definition: the same expression the proofs inline,
        compiled as a guard is (a conjunction becomes consecutive checks, a quantifier a loop)."""
        fns = self.readonly()
        parts = [self._emit_fn(d.name, fns[d.name]) for d in self.model.definitions]
        parts += [self._emit_fn(n, fns[n]) for n in (f"where_{f.name}" for f in self.model.lookups)]
        if not any(parts):
            return ""
        return self._rule("definitions") + "".join(f"{x}\n\n" for x in parts if x)

    def _where_head(self, f: StateFn) -> str:
        """The header of `where_<f>` (its loop variable is `x`, never `s`, the state)."""
        name, sort = f"where_{f.name}", f.args[0]
        return (f"def {name}(s: {self.state_type(name)}, v: {py_type(f.ret)}) -> list[int]:\n"
                + self._docstring(f"The {sort.name} x with {f.name}(x) == v, ascending "
                                  f"(`lookup({f.name})`)."))

    def _where_fn(self, f: StateFn) -> str:
        """`where_<f>(s, v)` for a `lookup(f)`: a scan here (the in-place core reads an index)."""
        return (self._where_head(f)
                + f"    return [x for x, w in enumerate(s.{f.name}) if w == v]\n")

    def _definition_fn(self, d: Any) -> str:
        head = (self._def(d.name, d, "bool")
                + self._docstring(d.doc or f"Definition {d.name}.")
                + self._range_checks(d))

        def build(counts: dict[tuple[Any, ...], int] | None) -> Body:
            b = Body(self, params=d.params, consts="s.consts", states={False: "s"},
                     mode="guard", counts=counts, local_names="s")
            b.select_memos([(d.body, ())])
            self._guard_stmt(b, d.name, d.body, "return False")
            b.stmt("return True")
            return b

        return head + self._two_pass(build)

    def _header(self, name: str, a: Any) -> str:
        """The header of `enabled_<a>` or `ready_<a>`: the parameters as keywords, None meaning
        unbound."""
        st = f"s: {self.state_type(name)}"
        kw = ", ".join(f"{p.name}: {py_type(p.sort)} | None = None" for p in a.params)
        sig = f"{st}, *, {kw}" if kw else st
        line = f"def {name}({sig}) -> bool:\n"
        if len(line) <= WIDTH + 1:
            return line
        if len(f"    {sig},") <= WIDTH:
            return f"def {name}(\n    {sig},\n) -> bool:\n"
        items = [st, "*"] + [
            f"{p.name}: {py_type(p.sort)} | None = None" for p in a.params]
        return f"def {name}(\n" + "".join(f"    {x},\n" for x in items) + ") -> bool:\n"

    def _enabled_fn(self, a: Any) -> str:
        """`enabled_<a>`: some value of the unbound parameters satisfies the guard (the spec's
        `enabled`). It and `ready_<a>` take the parameters as keywords, None meaning unbound;
        a caller never probes a guard with a dummy value and compares the failing conjunct's
        name."""
        read = self.guard_params(a)
        out = [self._header(f"enabled_{a.name}", a)]
        out.append(self._docstring(
            f"Whether `{a.name}`'s guard holds for the given parameters and some value of the\n"
            "others (None = unbound; an unbound parameter of a sort that cannot be enumerated\n"
            "is an error when the guard reads it)."))
        args, loops, looped, bound = [], [], [], []
        for p in a.params:
            if p.name not in read:
                args.append(f"{self.neutral(p.sort)} if {p.name} is None else {p.name}"
                            if p.sort.kind != "fn" else p.name)
                continue
            if p.sort.kind in ("index", "bool", "enum"):
                dom = {"index": f"range(s.consts.{p.sort.size})", "bool": "(False, True)",
                       "enum": f"range({len(p.sort.values)})"}[p.sort.kind]
                looped.append(f"    _{p.name}_all = {dom} if {p.name} is None else "
                              f"({p.name},)\n")
                loops.append(f"for {p.name} in _{p.name}_all")
                bound.append(p.name)
            else:
                out.append(f"    if {p.name} is None:\n"
                           f'        raise TypeError("enabled_{a.name}: {p.name} '
                           f'({p.sort.name}) cannot be enumerated; bind it")\n')
            args.append(p.name)
        call = f"{a.name}_guard({', '.join(['s', *args])}) is None"
        if loops:
            # every enumerable parameter given (the batcher's per-lane question): one guard
            # call, without the generator `any` runs (a quarter of the time)
            given = " and ".join(f"{n} is not None" for n in bound)
            out.append(render([f"    if {given}:"], indent=4) + "\n")
            out.append(render(["        return ", call], indent=8) + "\n")
            out.extend(looped)
            out.append(render(["    return ", genexpr("any", [call], loops)], indent=4) + "\n")
        else:
            out.append(f"    return {call}\n")
        return "".join(out)

    def _ready_fn(self, a: Any) -> str:
        """`ready_<a>`: the guard conjuncts that read only bound parameters hold."""
        out = [self._header(f"ready_{a.name}", a)]
        out.append(self._docstring(
            f"Whether every guard conjunct of `{a.name}` that reads only the given parameters\n"
            "holds (a conjunct reading an unbound parameter is skipped, whatever its position)."))
        out.append(self._range_checks(a, none_ok=True))
        bound_vars = params = list(a.params)

        def build(counts: dict[tuple[Any, ...], int] | None) -> Body:
            b = Body(self, params=params, consts="s.consts", states={False: "s"},
                     mode="guard", counts=counts, local_names="s")
            b.select_memos([(g, ()) for _, g in a.guards])
            for name, g in a.guards:
                reads = [p for p in bound_vars if reads_param(g, p)]
                if reads:
                    cond = " and ".join(f"{p.name} is not None" for p in reads)
                    with b.block(f"if {cond}:"):
                        self._guard_stmt(b, name, g, "return False")
                else:
                    self._guard_stmt(b, name, g, "return False")
            b.stmt("return True")
            return b

        out.append(self._two_pass(build))
        return "".join(out)

    def _guard_fn(self, a: Any) -> str:
        head = (self._def(f"{a.name}_guard", a, "str | None")
                + self._docstring(f"The first failing guard conjunct of `{a.name}`, or None.")
                + self._range_checks(a))

        def build(counts: dict[tuple[Any, ...], int] | None) -> Body:
            b = Body(self, params=a.params, consts="s.consts", states={False: "s"},
                     mode="guard", counts=counts, local_names="s")
            b.select_memos([(g, ()) for _, g in a.guards])
            for name, g in a.guards:
                self._guard_stmt(b, name, g, f'return "{name}"')
            b.stmt("return None")
            return b

        return head + self._two_pass(build)

    def _guard_stmt(self, b: Body, name: str, g: Expr, fail: str) -> None:
        """Fail unless `g` holds, as statements: conjunctions become consecutive checks,
        implications and conditionals become `if`, a universal quantifier a `for` loop with
        an early exit (faster than all(...)); evaluation order is the expression's."""
        nodes = self._guard_nodes(b, g, True, b.env0)
        b.flush()  # prerequisites of the whole compound go before it, never inside a loop
        b.comment(name)
        self._emit_nodes(b, nodes, fail)

    def _loop_nodes(self, b: Body, q: Quant, name: str, dom: str, pos: bool,
                    env: dict[int, str]) -> list[Any]:
        """A loop of `name` over `dom` whose body is `q`'s body as guard nodes (none if the
        body needs no check)."""
        inner = dict(env)
        inner[id(q.var)] = name
        b.loop_depth += 1
        body = self._guard_nodes(b, q.body, pos, inner)
        b.loop_depth -= 1
        return [("for", name, dom, body)] if body else []

    def _guard_nodes(self, b: Body, g: Expr, pos: bool, env: dict[int, str]) -> list[Any]:
        """Statements that fail unless `g` evaluates to `pos`."""
        t = type(g)
        if id(g) not in b.memo_occ:
            if t is Lit and isinstance(g.value, bool):
                return [] if g.value == pos else [("fail",)]
            if t is Not:
                return self._guard_nodes(b, g.arg, not pos, env)
            if (t is And and pos) or (t is Or and not pos):
                return [n for c in b._flatten(t, list(g.args))
                        for n in self._guard_nodes(b, c, pos, env)]
            if t is Implies and not pos:
                return self._guard_nodes(b, g.hyp, True, env) + \
                    self._guard_nodes(b, g.concl, False, env)
            if t is Implies:
                inner = self._guard_nodes(b, g.concl, True, env)
                if not inner:
                    return []
                hyp = b.expr(g.hyp, env)
                if len(inner) == 1 and inner[0][0] == "if" and inner[0][2] == [("fail",)] \
                        and not inner[0][3]:  # if h: if c: fail  ->  if h and c: fail
                    return [("if", b._chain("and", [hyp, inner[0][1]]), inner[0][2], [])]
                return [("if", hyp, inner, [])]
            if t is Ite:
                then = self._guard_nodes(b, g.then, pos, env)
                other = self._guard_nodes(b, g.other, pos, env)
                if not then and not other:
                    return []
                if not then:
                    return [("if", b.neg(g.cond, env), other, [])]
                return [("if", b.expr(g.cond, env), then, other)]
            if t is Quant and (g.kind == "forall") == pos and not self._whole(b, g):
                name = b.fresh(base_name(g.var), env)
                if not any(x is g.var for x in self.an.free(g.body)):
                    name = "_" + name
                return self._loop_nodes(b, g, name, b.domain(g.var.sort), pos, env)
        cond = b.neg(g, env) if pos else b.expr(g, env)
        return [("if", cond, [("fail",)], [])]

    @staticmethod
    def _whole(b: Body, q: Quant) -> bool:
        """The quantifier reads as any(memo)/all(memo): keep it an expression."""
        body = q.body
        if type(body) is Not and id(body) not in b.memo_occ:
            body = body.arg
        occ = b.memo_occ.get(id(body))
        return occ is not None and occ[1] is q.var

    def _emit_nodes(self, b: Body, nodes: list[Any], fail: str) -> None:
        for n in nodes:
            if n[0] == "fail":
                b.line(fail)
                continue
            b.line(self._if(n[1]) if n[0] == "if" else f"for {n[1]} in {n[2]}:")
            b.indent += 4
            self._emit_nodes(b, n[3] if n[0] == "for" else n[2], fail)
            b.indent -= 4
            while n[0] == "if" and len(n[3]) == 1 and n[3][0][0] == "if":
                n = n[3][0]
                b.line(["el", self._if(n[1])])
                b.indent += 4
                self._emit_nodes(b, n[2], fail)
                b.indent -= 4
            if n[0] == "if" and n[3]:
                b.line("else:")
                b.indent += 4
                self._emit_nodes(b, n[3], fail)
                b.indent -= 4

    def _plan_fn(self, a: Any) -> str:
        head = (self._def(f"{a.name}_plan", a, "tuple[Any, ...] | str")
                + self._docstring(
                    f"The effects `{a.name}` would have, or the first failing guard's name.\n\n"
                    "A parameter no effect reads (a token the planned call will sample) may\n"
                    "be None.")
                + self._range_checks(a, none_ok=True))

        def build(counts: dict[tuple[Any, ...], int] | None) -> Body:
            b = Body(self, params=a.params, consts="s.consts", states={False: "s"},
                     mode="action effect", counts=counts, local_names="s")
            b.select_memos([(g, ()) for _, g in a.guards]
                           + [(v, ()) for eff in a.effects for v in eff.args.values()])
            for name, g in a.guards:
                self._guard_stmt(b, name, g, f'return "{name}"')
            effects = [call_doc(self.effects[eff.name][0], [b._at(v, b.env0, TERN)
                                                         for v in eff.args.values()])
                       for eff in a.effects]
            b.stmt(["return ", tuple_doc(effects)])
            return b

        return head + self._two_pass(build)
