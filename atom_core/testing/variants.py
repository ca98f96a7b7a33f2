"""Variants of the spec the tests compare the model with (not planted bugs: other designs)."""

from __future__ import annotations

from atom_core.spec import lang as L
from atom_core.spec import model as spec


def seeds_semantics(model: L.Model | None = None) -> L.Model:
    """The seeds' scheduler (../shared/seeds/002): a prefix hit is mandatory and its entry is
    never taken over (no `admit_adopt`, and no hybrid miss evicting its hit's entry), so a
    request whose hit's entry is the only reusable block waits for a second block; with the
    prefix cache it needs one block more than the model (lanes + 2 with a reserved scratch
    block)."""
    m = model or spec.MODEL
    return (m.with_guard("admit_adopt", "not_hybrid", L.FALSE)
            .with_guard("admit_miss", "no_cache_hit", mandatory_hits(m)))


def mandatory_hits(model: L.Model | None = None) -> L.Expr:
    """The seeds' `no_cache_hit` for admit_miss: no miss while any hit exists (the model's
    without its hybrid exception, `hybrid_evicts_its_hit`)."""
    m = model or spec.MODEL
    (r,) = [p for p in m.get_action("admit_miss").params if p.name == "r"]
    return L.implies(spec.PREFIX, L.forall(spec.Block, lambda b: ~spec.hit_ok(r, b)))
