"""After the drain: every block and host slot at rest."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atom_core._generated import core

if TYPE_CHECKING:
    from atom_core.batcher import AtomBatcher


def at_rest(side: str, b: AtomBatcher) -> list[str]:
    s = b.state
    out = []
    if b.busy() or b.transfers():
        out.append(f"{side}: still busy after the drain (waiting {list(b.waiting)}, "
                   f"transfers {b.transfers()})")
    owners = [core.OWNER_NAMES[o] for o in s.owner]
    if not set(owners) <= {"FREE", "CACHE", "SCRATCH"}:
        out.append(f"{side}: blocks not at rest after the drain: {owners}")
    slots = [core.SLOTSTATE_NAMES[st] for st in s.slot_state]
    if not set(slots) <= {"EMPTY", "STORED"}:
        out.append(f"{side}: host slots not at rest after the drain: {slots}")
    return out
