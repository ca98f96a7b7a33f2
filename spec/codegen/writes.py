"""`WriteEmitter`: the in-place core's actions, which mutate MState: every new value (and
effect) computed from the pre-state first, then written; a conditional whole-function
update written only where its condition holds, straight from the loop or through a list
of changes; each write keeping the maintained indexes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from atom_core.spec import lang
from atom_core.spec.codegen.analysis import walk
from atom_core.spec.codegen.body import TERN, Body, base_name
from atom_core.spec.codegen.indexes import IndexEmitter, _conjuncts, _leaves
from atom_core.spec.codegen.printer import call_doc, render, tuple_doc
from atom_core.spec.lang import And, App, Expr, Ite, Lit, Or, StateFn, Var


class WriteEmitter(IndexEmitter):
    """The in-place action bodies: a compute phase, then the writes (deferred closures)."""

    def reject(self, guard: str) -> str:
        # (the Step itself, as an accepted action builds it: MState is not core.State)
        return f'return _new(Step, (s, (), "{guard}"))'

    def _action_body(self, a: Any, counts: dict[tuple[Any, ...], int] | None) -> Body:
        b, per_fn, fns, plain, ghost = self._action_head(a, counts)
        updated = set(per_fn)
        # compute phase: every new value from the pre-state; writes are deferred (closures)
        direct: dict[bool, list[Callable[[], None]]] = {False: [], True: []}
        writes: dict[bool, list[Callable[[], None]]] = {False: [], True: []}
        for n in plain:
            self._compute(b, fns[n], per_fn[n], updated, direct[False], writes[False])
        effects = []
        for eff in a.effects:
            cls = self.effects[eff.name][0]
            effects.append(call_doc("_new", [cls, tuple_doc(
                [b._at(v, b.env0, TERN) for v in eff.args.values()])]))
        if effects:
            b.stmt(["effects = ", tuple_doc(effects)])
        if ghost:
            n_lines = len(b.lines)
            with b.block("if s.ghost:"):
                for n in ghost:
                    self._compute(b, fns[n], per_fn[n], updated, direct[True], writes[True])
            if len(b.lines) == n_lines + 1:  # only literals or parameters: no block at all
                b.lines.pop()
        # write phase: direct loops first (they read the pre-state of what they read)
        for w in direct[False]:
            w()
        if direct[True] or writes[True]:
            with b.block("if s.ghost:"):
                for w in direct[True] + writes[True]:
                    w()
        for w in writes[False]:
            w()
        b.stmt(f"return _new(Step, (s, {'effects' if effects else '()'}, None))")
        return b

    def _temp(self, b: Body, name: str, e: Expr) -> Any:
        """`e`'s value in the pre-state: a literal or parameter as is, else a local."""
        if type(e) is Lit or (type(e) is Var and id(e) in b.param_ids):
            return b.top(e)[0]
        b.stmt(self._assign(name, b.top(e)))
        return name

    def _chain_of(self, f: StateFn, vs: list[Var], e: Expr) -> list[tuple[Any, Expr | None]] | None:
        """`e` as [(cond, value), ...] ending in f(vs) (first true cond wins, else unchanged);
        a cond is ("pos"|"neg", expr) or ("or"|"nor", [exprs]); value None: True/False."""
        def is_self(x: Expr) -> bool:
            return (type(x) is App and x.fn is f and not x.post and len(x.args) == len(vs)
                    and all(a is v for a, v in zip(x.args, vs, strict=True)))

        out: list[tuple[Any, Any]] = []
        while not is_self(e):
            t = type(e)
            if t is Ite:
                if is_self(e.other) or not is_self(e.then):
                    out.append((("pos", e.cond), e.then))
                    e = e.other
                else:
                    out.append((("neg", e.cond), e.other))
                    e = e.then
            elif t in (Or, And) and sum(1 for x in e.args if is_self(x)) == 1 \
                    and f.ret.kind == "bool":
                rest = [x for x in e.args if not is_self(x)]
                out.append((("or", rest), Lit(True, lang.BOOL)) if t is Or
                           else (("nor", rest), Lit(False, lang.BOOL)))
                return out
            else:
                return None
        return out

    def _cond_doc(self, b: Body, cond: Any, env: dict[int, str]) -> tuple[Any, int]:
        kind, x = cond
        if kind == "pos":
            return b.expr(x, env)
        if kind == "neg":
            return b.neg(x, env)
        if kind == "or":
            return b._chain("or", [b.expr(y, env) for y in x])
        return b._chain("or", [b.neg(y, env) for y in x])

    def _direct_ok(self, f: StateFn, vs: list[Var], e: Expr, updated: set[str]) -> bool:
        if not self.an.total(e):
            return False
        for x in walk(e):
            if type(x) is App and isinstance(x.fn, StateFn) and x.fn.name in updated:
                if not (x.fn is f and not x.post and len(x.args) == len(vs)
                        and all(a is v for a, v in zip(x.args, vs, strict=True))):
                    return False
        return True

    def _compute(self, b: Body, f: StateFn, ups: list[Any], updated: set[str],
                 direct: list[Callable[[], None]], writes: list[Callable[[], None]]) -> None:
        lay = self.layout(f)
        new = f"new_{f.name}"
        if lay == "scalar":
            b.stmt(self._assign(new, b.top(ups[-1].value)))
            writes.append(lambda: [b.stmt(x) for x in [f"s.{f.name} = {new}",
                                                       *self._ix_rebuild(f.name)]])
            return
        whole = ups[0] if ups and ups[0].whole else None
        points = [u for u in ups if not u.whole]
        if lay == "map":
            self._compute_map(b, f, points, writes)
            return
        if whole is not None:
            vs = list(whole.args)
            chain = self._chain_of(f, vs, whole.value)
            if chain is None:  # a fresh list (of lists), replacing the field
                b.stmt([f"{new} = ", self._tabulate(b, whole.value, vs, b.env0, as_list=True)])
                for u in points:
                    idx = [["[", b.top(x)[0], "]"] for x in u.args]
                    b.stmt([new, *idx, " = ", self._breakable(b.top(u.value))])
                writes.append(lambda: [b.stmt(x) for x in [f"s.{f.name} = {new}",
                                                       *self._ix_rebuild(f.name)]])
                return
            if self._direct_ok(f, vs, whole.value, updated):
                direct.append(lambda: self._chain_loop(b, f, vs, chain, None))
            else:
                b.stmt(f"{new}: list[Any] = []")
                self._chain_loop(b, f, vs, chain, new)
                writes.append(lambda: self._apply_changes(b, f, vs, new))
        temps = []
        for i, u in enumerate(points):
            idx = [self._temp(b, f"{new}_i{i}{j}", x) for j, x in enumerate(u.args)]
            val = self._temp(b, f"{new}_v{i}", u.value)
            temps.append((idx, val))
        if temps:
            def write_points() -> None:
                arr = b.field(f, False)
                for idx, val in temps:
                    pre, post = self._ix_pre_post(f.name, idx[0]) if len(idx) == 1 \
                        else ([], [])
                    for x in pre:
                        b.stmt(x) if not x.startswith(" ") else b.line(x)
                    b.stmt([arr, *(["[", x, "]"] for x in idx), " = ", val])
                    for x in post:
                        b.stmt(x) if not x.startswith(" ") else b.line(x)
            writes.append(write_points)

    def _chain_loop(self, b: Body, f: StateFn, vs: list[Var],
                    chain: list[tuple[Any, Expr]], collect: str | None) -> None:
        """for v in range(N): if c1: f[v] = x1 (elif ...); or append (v, x1) to `collect`."""
        env = dict(b.env0)
        names = []
        for v in vs:
            name = b.fresh(base_name(v), env)
            env[id(v)] = name
            names.append(name)
        doms = [f"range({b.size(v.sort)})" for v in vs]
        leaves_out: tuple[Any, ...] | None = None  # the sel index every write leaves
        drop: str | None = None  # how a leaving x is taken out of that index's set
        if len(vs) == 1 and len(chain) == 1 and chain[0][0][0] == "pos":
            sel = self._sel_match(chain[0][0][1], vs[0])
            if sel is not None and sel[0] in self.indexes:  # only the blocks it selects
                self.used_ix.add(sel[0])
                w = render(b.expr(sel[1], b.env0)[0])
                doms = [f"tuple(s.{self._ix_slot(sel[0])}.get({w}, ()))"]
                leaves = _leaves(chain[0][1])
                if f.name == sel[0][1] and all(type(x) is Lit and x.value != sel[0][2]
                                               for x in leaves):
                    # the condition put x in the set, the new value takes it out
                    leaves_out = sel[0]
                    drop = f"s.{self._ix_slot(sel[0])}[{w}].discard"
                    if len(_conjuncts(chain[0][0][1])) == 2:
                        # the condition is the selection itself: every x in the set meets
                        # it and leaves, so the set goes whole
                        doms = [f"s.{self._ix_slot(sel[0])}.pop({w}, ())"]
                        drop = None
        b.loop_depth += 1
        arms = [(self._cond_doc(b, c, env), b._at(x, env, TERN))
                for c, x in chain]
        arr = b.field(f, False) if collect is None else None
        b.loop_depth -= 1
        b.flush()  # prerequisites before the loop, never inside it
        for name, dom in zip(names, doms, strict=True):
            b.line(f"for {name} in {dom}:")
            b.indent += 4
        target = [arr, *(f"[{n}]" for n in names)] if collect is None else None
        pre, post = self._ix_pre_post(f.name, names[0], skip=leaves_out) if len(vs) == 1 \
            else ([], [])
        if leaves_out is not None and drop is not None:
            pre = [f"{drop}({names[0]})", *pre]
        for i, (cond, val) in enumerate(arms):
            b.line([("if " if i == 0 else "elif "), self._breakable(cond), ":"])
            b.indent += 4
            if collect is None:
                for x in pre:
                    b.line(x)
                b.line([*target, " = ", val])
                for x in post:
                    b.line(x)
            else:
                key = names[0] if len(names) == 1 else "(" + ", ".join(names) + ")"
                b.line([f"{collect}.append(({key}, ", val, "))"])
            b.indent -= 4
        b.indent -= 4 * len(names)

    def _apply_changes(self, b: Body, f: StateFn, vs: list[Var], new: str) -> None:
        arr = b.field(f, False)
        b.flush()
        if len(vs) == 1:
            pre, post = self._ix_pre_post(f.name, "_k")
            b.line(f"for _k, _v in {new}:")
            for x in [*pre, f"{arr}[_k] = _v", *post]:
                b.line(f"    {x}")
        else:
            b.line(f"for (_k, _j), _v in {new}:")
            b.line(f"    {arr}[_k][_j] = _v")

    def _compute_map(self, b: Body, f: StateFn, points: list[Any],
                     writes: list[Callable[[], None]]) -> None:
        new = f"new_{f.name}"
        dflt = self.defaults.get(f.name)
        init = self._init_value(f)[0]
        temps = []
        for i, u in enumerate(points):
            k = self._temp(b, f"{new}_k{i}", u.args[0])
            v = self._temp(b, f"{new}_v{i}", u.value)
            if type(u.value) is Lit and type(init) is Lit:
                how = "pop" if u.value.value == init.value else "set"
            elif type(u.value) is Lit and init is None:
                how = "pop" if u.value.value is None else "set"
            elif type(u.value) is Var and id(u.value) in b.param_ids \
                    and u.value.sort.kind == "index" and init is None:
                how = "set"  # an index parameter is range-checked: never None
            else:
                how = "test"
            temps.append((k, v, how))

        def write() -> None:
            d = b.field(f, False)
            for k, v, how in temps:
                if how == "set":
                    b.stmt([d, "[", k, "] = ", v])
                elif how == "pop":
                    b.stmt([d, ".pop(", k, ", None)"])
                else:
                    test = f"{v} is None" if dflt is None else f"{v} == {dflt}"
                    b.stmt(f"if {test}:")
                    b.indent += 4
                    b.line([d, ".pop(", k, ", None)"])
                    b.indent -= 4
                    b.line("else:")
                    b.indent += 4
                    b.line([d, "[", k, "] = ", v])
                    b.indent -= 4
        writes.append(write)
