"""Each request's prompt tokens served from the prefix cache or the host tier (the usage's
`prompt_tokens_details.cached_tokens`), counted from the scheduler's transitions: a listener on
the engine thread, as the dashboard's `Recorder` is. A hit copies (`Copy`) or loads (`Load`)
n tokens into a lane's block; an entry a lane takes over at admission keeps its KV, so the
lane's length grows in that transition without a copy."""

from __future__ import annotations

from typing import Any

from atom_core._generated import core


class HitCounter:
    def __init__(self, view: Any) -> None:
        self.view = view
        self.lengths = list(view.length)  # each lane's length before the transition
        # request id -> its tokens hit; taken (popped) by the server when the request ends
        self.cached: dict[int, int] = {}

    def __call__(self, effects: Any) -> None:
        v = self.view
        if effects:
            hits = [(e.lane, e.n) for e in effects if isinstance(e, (core.Copy, core.Load))]
            if not hits:  # (a take-over: its KV kept, the length grew at admission)
                hits = [(e.lane, v.length[e.lane] - self.lengths[e.lane]) for e in effects
                        if isinstance(e, core.Admit)]
            for lane, n in hits:
                if n > 0:
                    r = int(v.lane_req[lane])
                    self.cached[r] = self.cached.get(r, 0) + n
        self.lengths[:] = v.length

    def take(self, rid: int | None) -> int:
        """A request's hit tokens (0 for none), forgotten here."""
        return 0 if rid is None else self.cached.pop(rid, 0)
