"""The host cache tier between ticks: nothing in flight, `describe()` agrees with the core."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atom_core._generated import core

if TYPE_CHECKING:
    from atom_core.simulate.servers import Server


def host_tier_leaks(server: Server) -> list[str]:
    """The host cache tier, by side: the adapter stores and loads within a step, so between
    ticks no slot is storing or loading (a spilling block is `block_leaks`' concern); and every
    slot's state and tokens in `describe()["host_cache"]` are the core's."""
    out = []
    for side, b in server.batchers().items():
        s = b.state
        if not s.consts.H:
            continue
        for h, st in enumerate(s.slot_state):
            if st in (core.SLOTSTATE_STORING, core.SLOTSTATE_LOADING):
                what = f"block {s.slot_block[h]}" if st == core.SLOTSTATE_STORING \
                    else f"into lane {s.load_lane[h]}'s block"
                out.append(f"{side}: host slot {h} is still {core.SLOTSTATE_NAMES[st].lower()} "
                           f"({what}) between ticks")
        described = b.describe()["host_cache"]
        want = [{"slot": h, "state": core.SLOTSTATE_NAMES[st].lower(),
                 "tokens": len(s.slot_key[h])} for h, st in enumerate(s.slot_state)]
        if described != want:
            got = {d.get("slot"): d for d in described}
            for w in want:
                d = got.pop(w["slot"], None)
                if d != w:
                    out.append(f"{side}: describe() reports host slot {w['slot']} as {d}, the "
                               f"core has {w}")
            out += [f"{side}: describe() reports a host slot {h} the core does not have"
                    for h in got]
    return out
