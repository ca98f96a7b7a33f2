"""Enumeration: the mutant families, from the model (`catalogue`, `select`), and each
mutant's generated core (`load_core`, `load_inplace_core`) and capacity table (`patched_table`)."""

from __future__ import annotations

import fnmatch
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from atom_core.spec import lang as L

FAMILIES = ("guard", "update", "swap", "pin", "free", "capacity")
# State that pins a block (a copy's source, a PD transfer's block) and who holds the pin.
PIN_FNS = ("copying", "copy_src", "transfer", "transfer_req")
CONTROL = "control"  # the unmutated model, run through every layer like a mutant


@attrs.frozen
class Mutant:
    id: str
    family: str
    description: str
    actions: tuple[str, ...]  # the actions it changes (z3 re-checks only these)
    change: Callable[[L.Model], L.Model] = attrs.field(eq=False, repr=False)
    offsets: dict[tuple[bool, str], int] | None = None  # a capacity table replacing the proved


def only(model: L.Model, actions: tuple[str, ...]) -> L.Model:
    """`model` with only `actions`: a mutant of an action changes only that action's step and
    transition obligations (the restriction tests/test_proofs.py cross-checks)."""
    m = model.copy()
    m.actions = [a for a in m.actions if a.name in actions]
    return m


def edit_updates(model: L.Model, action: str,
                 edit: Callable[[list[L.Update]], list[L.Update]]) -> L.Model:
    """A copy of `model` whose `action` has the update list `edit` returns (Model.copy copies
    each action's lists, so the original is untouched)."""
    m = model.copy()
    a = m.get_action(action)
    a.updates = edit(list(a.updates))
    return m


def drop_update(model: L.Model, action: str, index: int) -> L.Model:
    return edit_updates(model, action, lambda us: us[:index] + us[index + 1:])


def with_value(model: L.Model, action: str, index: int, value: L.Expr) -> L.Model:
    """`action`'s index-th update assigns `value` instead (Model has with_guard for guards but
    nothing for an update's value)."""
    def edit(us: list[L.Update]) -> list[L.Update]:
        u = us[index]
        us[index] = L.Update(u.fn, u.args, value, u.whole)
        return us
    return edit_updates(model, action, edit)


def with_extra_update(model: L.Model, action: str, index: int, extra: L.Update) -> L.Model:
    """`extra` runs just before the index-th update, so where both write the same point the
    original still wins (later point updates win): the mutant differs only elsewhere."""
    return edit_updates(model, action, lambda us: us[:index] + [extra] + us[index:])


def same(a: Any, b: Any) -> bool:
    """Structural equality of terms (`==` on expressions builds a term)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, L.App):
        return (a.fn is b.fn and a.post == b.post and len(a.args) == len(b.args)
                and all(same(x, y) for x, y in zip(a.args, b.args, strict=True)))
    if isinstance(a, L.Lit):
        return a.sort is b.sort and a.value == b.value
    return False


def children(e: L.Expr) -> Iterator[L.Expr]:
    """Direct subterms, read from the node's slots (so new node types need nothing here)."""
    for cls in type(e).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name in ("sort", "fn", "var", "action"):
                continue
            v = getattr(e, name, None)
            vs = v.values() if isinstance(v, dict) else v if isinstance(v, tuple) else (v,)
            yield from (x for x in vs if isinstance(x, L.Expr))


def mentions(e: L.Expr, member: str) -> bool:
    if isinstance(e, L.Lit) and e.value == member:
        return True
    return any(mentions(c, member) for c in children(e))


def show(e: Any) -> str:
    """A short rendering for mutant ids and descriptions."""
    if isinstance(e, L.Var):
        return e.name
    if isinstance(e, L.Const):
        return e.name
    if isinstance(e, L.Lit):
        return str(e.value)
    if isinstance(e, L.App):
        return f"{e.fn.name}({', '.join(show(a) for a in e.args)})"
    if isinstance(e, L.Not):
        return f"~{show(e.arg)}"
    return f"<{type(e).__name__.lower()}>"


def terms(model: L.Model, action: L.Action, sort: L.Sort) -> list[L.Expr]:
    """Terms of `sort` an action can name: a parameter, or a state function applied to one,
    once or twice (`table(req_lane(r))`). The slips a planted bug makes: a wrong but
    well-typed argument. Ghost state is left out: no executable update may read it."""
    unary = [f for f in model.state if not f.ghost and len(f.args) == 1]
    level = [p for p in action.params if p.sort.kind != "fn"]
    found: list[L.Expr] = list(level)
    for _ in range(2):
        level = [f(t) for t in level for f in unary if f.args[0] is t.sort]
        found += level
    return [t for t in found if t.sort is sort]


def update_name(a: L.Action, i: int) -> str:
    """`fn`, or `fn#k` when the action assigns fn more than once."""
    u = a.updates[i]
    same_fn = [j for j, v in enumerate(a.updates) if v.fn is u.fn]
    return u.fn.name if len(same_fn) == 1 else f"{u.fn.name}#{same_fn.index(i) + 1}"


def target(u: L.Update) -> str:
    return f"{u.fn.name}" if u.whole else show(u.fn(*u.args))


def guard_drops(model: L.Model) -> Iterator[Mutant]:
    for a in model.actions:
        for g, _ in a.guards:
            yield Mutant(f"drop-guard:{a.name}.{g}", "guard", f"{a.name} without guard {g}",
                         (a.name,), functools.partial(L.Model.without_guard, action=a.name,
                                                      guard=g))


def update_drops(model: L.Model) -> Iterator[Mutant]:
    for a in model.actions:
        for i, u in enumerate(a.updates):
            family = "pin" if u.fn.name in PIN_FNS else "update"
            yield Mutant(f"drop-update:{a.name}.{update_name(a, i)}", family,
                         f"{a.name} skips {target(u)} := {show(u.value)}", (a.name,),
                         functools.partial(drop_update, action=a.name, index=i))


def wrong_values(model: L.Model, a: L.Action, u: L.Update) -> list[L.Expr]:
    """Wrong values for a pin update: the negation of a flag, another term of an index sort."""
    if u.value.sort is L.BOOL:
        flipped = (L.Lit(not u.value.value, L.BOOL) if isinstance(u.value, L.Lit)
                   else L.Not(u.value))
        return [flipped]
    if u.whole:
        return []
    lhs = u.fn(*u.args)
    return [t for t in terms(model, a, u.value.sort) if not same(t, u.value) and not same(t, lhs)]


def value_mutants(model: L.Model, prefix: str, family: str,
                  chosen: Callable[[L.Update], bool]) -> Iterator[Mutant]:
    """Each `chosen` update given each of its wrong values."""
    for a in model.actions:
        for i, u in enumerate(a.updates):
            if not chosen(u):
                continue
            for v in wrong_values(model, a, u):
                yield Mutant(f"{prefix}:{a.name}.{update_name(a, i)}={show(v)}", family,
                             f"{a.name} sets {target(u)} := {show(v)} (not {show(u.value)})",
                             (a.name,), functools.partial(with_value, action=a.name, index=i,
                                                          value=v))


def pin_values(model: L.Model) -> Iterator[Mutant]:
    return value_mutants(model, "wrong-value", "pin", lambda u: u.fn.name in PIN_FNS)


def swappable(u: L.Update) -> bool:
    """An update of a flag, an index or identity (a lane, block, request or slot) or an enum
    (an owner, phase or slot state), and not a pin (those are the pin family's): one of the
    other values the action can name is a plausible slip. Token sequences and integers are
    left to `update` (dropped) and to the source mutants: their wrong values are endless."""
    return u.fn.name not in PIN_FNS and (u.value.sort is L.BOOL
                                         or u.value.sort.kind in ("index", "ident", "enum"))


def swapped_values(model: L.Model) -> Iterator[Mutant]:
    return value_mutants(model, "swap-value", "swap", swappable)


def freeing(u: L.Update) -> bool:
    """A point update that may set an owner-like function (an enum with FREE) to FREE."""
    ret = u.fn.ret
    return (not u.whole and ret.kind == "enum" and "FREE" in ret.values and len(u.args) == 1
            and mentions(u.value, "FREE"))


def double_frees(model: L.Model) -> Iterator[Mutant]:
    for a in model.actions:
        for i, u in enumerate(a.updates):
            if not freeing(u):
                continue
            for t in terms(model, a, u.args[0].sort):
                if same(t, u.args[0]):
                    continue
                extra = L.Update(u.fn, (t,), L.Lit("FREE", u.fn.ret), False)
                yield Mutant(f"free-twice:{a.name}.{u.fn.name}({show(t)})", "free",
                             f"{a.name} releases {show(u.fn(*u.args))} and also frees "
                             f"{show(t)}", (a.name,),
                             functools.partial(with_extra_update, action=a.name, index=i,
                                               extra=extra))


def committed_capacity() -> types.ModuleType:
    from atom_core._generated import capacity

    return capacity


def capacity_short(model: L.Model) -> Iterator[Mutant]:
    cap = committed_capacity()
    for key, offset in cap.OFFSETS.items():
        offsets = {**cap.OFFSETS, key: offset - 1}
        rule = cap.RULE_NAMES[key]
        short = offset - 1
        yield Mutant(f"capacity:{rule}-1", "capacity",
                     f"{rule} one block short: kv_blocks >= lanes {'-' if short < 0 else '+'} "
                     f"{abs(short)}", (), lambda m: m, offsets)


def enumerate_mutants(model: L.Model) -> list[Mutant]:
    out = [*guard_drops(model), *update_drops(model), *swapped_values(model), *pin_values(model),
           *double_frees(model), *capacity_short(model)]
    ids = [m.id for m in out]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    return out


@functools.cache
def base_model() -> L.Model:
    from atom_core.spec.model import MODEL

    return MODEL


@functools.cache
def catalogue() -> dict[str, Mutant]:
    control = Mutant(CONTROL, "control", "the unmutated model", (), lambda m: m)
    return {m.id: m for m in [control, *enumerate_mutants(base_model())]}


def select(pattern: str | None, sample: int | None = None) -> list[Mutant]:
    """The mutants whose id matches `pattern` (a glob, or else a substring); with `sample`,
    that many spread evenly over them (every family, in catalogue order): a quick estimate."""
    ms = [m for m in catalogue().values() if m.id != CONTROL]
    if pattern:
        glob = any(ch in pattern for ch in "*?[")
        ms = [m for m in ms if (fnmatch.fnmatchcase(m.id, pattern) if glob else pattern in m.id)]
    if sample is not None and 0 < sample < len(ms):
        ms = [ms[i * len(ms) // sample] for i in range(sample)]
    return ms


def patched_table(offsets: dict[tuple[bool, str], int]) -> types.ModuleType:
    """The committed capacity module with `offsets` as its T = 1 offsets, and its rule for
    every T moved by the same number of blocks (a capacity mutant is one block short at
    every table size)."""
    cap = committed_capacity()
    table = types.ModuleType(cap.__name__)
    table.__dict__.update({k: v for k, v in vars(cap).items() if not k.startswith("__")})
    table.OFFSETS = dict(offsets)

    def min_kv_blocks(lanes: int, tables: int, key: tuple[bool, str]) -> int:
        return cap.min_kv_blocks(lanes, tables, key) + offsets[key] - cap.OFFSETS[key]

    table.min_kv_blocks = min_kv_blocks
    return table


def offsets_of(m: Mutant) -> dict[tuple[bool, str], int]:
    return m.offsets if m.offsets is not None else dict(committed_capacity().OFFSETS)


@functools.cache
def load_core(mutant_id: str) -> types.ModuleType:
    """The generated core of a mutant (cached: the layers of one mutant share it)."""
    from atom_core.spec import codegen

    m = catalogue()[mutant_id]
    return codegen.load(m.change(base_model()), "atom_core_mutant_core")


def load_inplace_core(mutant_id: str) -> types.ModuleType:
    """The generated in-place core of a mutant, which imports from (and holds as `_core`) the
    pure core generated with it: the batcher runs the one, the policy and checks read the
    other."""
    from atom_core.spec import codegen

    m = catalogue()[mutant_id]
    return codegen.load_inplace(m.change(base_model()), "atom_core_mutant_inplace")
