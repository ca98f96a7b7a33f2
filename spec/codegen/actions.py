"""`ActionEmitter`: the actions of the pure core (each a function returning a new State and
its effects), the ACTIONS and GUARD_READS tables, and the tabulation of a whole-function
value (also used by init and the in-place core)."""

from __future__ import annotations

import textwrap
from typing import Any

from atom_core.spec.codegen.analysis import modifies, reads_param
from atom_core.spec.codegen.base import _none_all
from atom_core.spec.codegen.body import OR, TERN, Body, base_name
from atom_core.spec.codegen.guards import GuardEmitter
from atom_core.spec.codegen.printer import (
    SPACE,
    WIDTH,
    bracket,
    call_doc,
    dict_doc,
    render,
    tabulate_doc,
    tuple_doc,
)
from atom_core.spec.lang import Expr, StateFn, Var


def _modifies_comment(a: Any) -> str:
    plain, ghost = modifies(a)
    text = "modifies: " + (", ".join(plain) or "nothing")
    if ghost:
        text += "; ghost: " + ", ".join(ghost)
    return "".join(f"    # {line}\n" for line in textwrap.wrap(
        text, WIDTH - 6, subsequent_indent="  ", break_on_hyphens=False))


class ActionEmitter(GuardEmitter):
    """Emits the actions section: per action its guard, the action, its plan, `enabled_`
    and `ready_`, then the tables."""

    def _actions(self) -> str:
        parts = [self._rule("actions")]
        fns = self.readonly()
        for a in self.model.actions:
            names = [f"{a.name}_guard", a.name, *([f"{a.name}_plan"] if a.effects else []),
                     f"enabled_{a.name}", f"ready_{a.name}"]
            for name in names:
                text = self._emit_fn(name, fns[name] if name != a.name else
                                     lambda a=a: self._action_fn(a))
                if text:
                    parts.append(text)
                    parts.append("\n\n")
        items = []
        for a in self.model.actions:
            pn = tuple_doc([f'"{p.name}"' for p in a.params])
            ps = tuple_doc([f'"{p.sort.name}"' for p in a.params])
            items.append([f'"{a.name}": ', tuple_doc([a.name, f"{a.name}_guard", pn, ps])])
        parts.append("# name -> (action, guard, parameter names, parameter sorts)\n")
        parts.append(render(["ACTIONS = ", dict_doc(items)]))
        parts.append("\n")
        reads = []
        for a in self.model.actions:
            per = [[f'"{name}": ', tuple_doc([f'"{p.name}"' for p in a.params
                                          if reads_param(e, p)])] for name, e in a.guards]
            reads.append([f'"{a.name}": ', dict_doc(per)])
        parts.append("# name -> guard name -> the parameters it reads (a search that finds a\n"
                     "# guard refusing some arguments skips every call that agrees on those)\n")
        parts.append(render(["GUARD_READS = ", dict_doc(reads)]))
        parts.append("\n")
        return "".join(parts)

    def _action_fn(self, a: Any) -> str:
        head = (self._def(a.name, a, "Step")
                + self._docstring(a.doc or f"Action {a.name}.")
                + _modifies_comment(a)
                + self._range_checks(a))
        return head + self._two_pass(lambda counts: self._action_body(a, counts))

    def _action_head(self, a: Any, counts: dict[tuple[Any, ...], int] | None) -> tuple[
            Body, dict[str, list[Any]], dict[str, StateFn], list[str], list[str]]:
        """What both cores' actions start with: the body with its memos chosen and the guards
        emitted, and the updates grouped per function in spec order (the last whole or scalar
        update wins): (body, updates per function, functions, plain names, ghost names)."""
        b = Body(self, params=a.params, consts="s.consts", states={False: "s"},
                 mode="action effect", counts=counts, local_names="s new effects")
        per_fn: dict[str, list[Any]] = {}
        fns: dict[str, StateFn] = {}
        for u in a.updates:
            fns[u.fn.name] = u.fn
            ups = per_fn.setdefault(u.fn.name, [])
            if u.whole or self.layout(u.fn) == "scalar":
                ups[:] = [u]
            else:
                ups.append(u)
        plain = [n for n in per_fn if not fns[n].ghost]
        ghost = [n for n in per_fn if fns[n].ghost]

        def roots(names: list[str]) -> list[tuple[Expr, tuple[Var, ...]]]:
            out: list[tuple[Expr, tuple[Var, ...]]] = []
            for n in names:
                for u in per_fn[n]:
                    out.append((u.value, tuple(u.args) if u.whole else ()))
                    if not u.whole:
                        out.extend((x, ()) for x in u.args)
            return out

        main = [(g, ()) for _, g in a.guards] + roots(plain)
        main += [(v, ()) for eff in a.effects for v in eff.args.values()]
        b.select_memos(main, roots(ghost))
        for name, g in a.guards:
            self._guard_stmt(b, name, g, self.reject(name))
        return b, per_fn, fns, plain, ghost

    def reject(self, guard: str) -> str:
        """The statement by which an action refuses, naming the conjunct that failed."""
        return f'return Step(s, (), "{guard}")'

    def _action_body(self, a: Any, counts: dict[tuple[Any, ...], int] | None) -> Body:
        b, per_fn, fns, plain, ghost = self._action_head(a, counts)
        for n in plain:
            self._update(b, fns[n], per_fn[n])
        effects = []
        for eff in a.effects:
            cls = self.effects[eff.name][0]
            effects.append(call_doc(cls, [b._at(v, b.env0, TERN) for v in eff.args.values()]))
        if effects:
            b.stmt(["effects = ", tuple_doc(effects)])
        if ghost:
            with b.block("if s.ghost:"):
                for n in ghost:
                    self._update(b, fns[n], per_fn[n])
            with b.block("else:"):
                for line in _none_all([f"new_{n}" for n in ghost], b.indent):
                    b.stmt(line)
        if not per_fn:  # nothing changes: the same state object
            b.stmt(f"return Step(s, {'effects' if effects else '()'}, None)")
            return b
        args = ["s.consts", "s.ghost"]
        for f in self.model.state:
            if f.name in per_fn:
                args.append(f"new_{f.name}")
            elif b._defined(("field", f.name, False)):
                args.append(b.field_local[(f.name, False)])
            else:
                args.append(f"s.{f.name}")
        b.stmt(["new = ", call_doc("State", args)])
        b.stmt(f"return Step(new, {'effects' if effects else '()'}, None)")
        return b

    def _update(self, b: Body, f: StateFn, ups: list[Any]) -> None:
        lay = self.layout(f)
        new = f"new_{f.name}"
        whole = ups[0] if ups and ups[0].whole else None
        points = [u for u in ups if not u.whole]
        if lay == "scalar":
            u = ups[-1]
            b.stmt(self._assign(new, b.top(u.value)))
            return
        if lay == "map":
            src = b.field(f, False)
            if len(points) == 1:
                k, v = (b._at(x, b.env0, TERN) for x in (points[0].args[0], points[0].value))
                b.stmt([f"{new} = ", call_doc(f"{src}.set", [k, v])])
            else:
                pairs = [tuple_doc([b._at(x, b.env0, TERN) for x in (u.args[0], u.value)])
                         for u in points]
                b.stmt([f"{new} = ", call_doc(f"{src}.set_many", [tuple_doc(pairs)])])
            return
        # tuple layout
        if whole is not None and not points:
            b.stmt([f"{new} = ", self._tabulate(b, whole.value, list(whole.args), b.env0)])
            return
        nested = len(f.args) == 2
        if whole is not None:
            b.stmt([f"{new} = ", self._tabulate(b, whole.value, list(whole.args), b.env0,
                                                as_list=True)])
        elif nested:
            b.stmt(f"{new} = [list(row) for row in {b.field(f, False)}]")
        else:
            b.stmt(f"{new} = list({b.field(f, False)})")
        for u in points:
            idx = [["[", b.top(x)[0], "]"] for x in u.args]
            b.stmt([new, *idx, " = ", self._breakable(b.top(u.value))])
        b.stmt(f"{new} = tuple(map(tuple, {new}))" if nested else f"{new} = tuple({new})")

    def _tabulate(self, b: Body, e: Expr, vs: list[Var], env: dict[int, str],
                  as_list: bool = False) -> Any:
        """tuple([e for v0 in range(N0)]), nested per argument; a constant e is repeated.
        `as_list`: lists (of lists), for point updates to follow."""
        depends = [v for v in vs if any(x is v for x in self.an.free(e))]
        if not depends and not as_list:
            val = b.expr(e, env)[0]
            for v in reversed(vs):
                val = [bracket("(", [val, ","], ")"), f" * {b.size(v.sort)}"]
            return val
        inner = dict(env)
        names = []
        for v in vs:
            name = b.fresh(base_name(v), inner)
            inner[id(v)] = name
            names.append(name)
        b.loop_depth += 1
        val = b._at(e, inner, OR)
        for v, name in reversed(list(zip(vs, names, strict=True))):
            clause = f"for {name} in range({b.size(v.sort)})"
            val = bracket("[", [val, SPACE, clause], "]") if as_list else \
                tabulate_doc(val, [clause])
        b.loop_depth -= 1
        return val
