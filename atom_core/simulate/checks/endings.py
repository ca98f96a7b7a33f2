"""When a request ends: it ends once, and with the oracle's tokens (all of them if it finished,
a prefix of them otherwise)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from atom_core.simulate.driver import Sim


def ending_problems(sim: Sim, i: int, kind: str) -> Iterator[tuple[str, str]]:
    """(failure kind, detail) for request `i`, which just ended (`kind`: finished, error,
    abort). A generator: a repeated ending is reported before the server and the oracle are
    asked, so a crash in either still follows it."""
    outcomes = sim.outcomes[i]
    if len(outcomes) > 1:
        yield "lifecycle", f"request {i} ended {len(outcomes)} times: {outcomes}"
    tokens, error = sim.server.result(sim.ids[i])
    it = sim.workload[i]
    want = sim.oracle.generate(list(it.prompt), it.max_new_tokens, it.eos)
    if kind == "finished":
        if error is not None:
            yield "lifecycle", f"request {i} finished with error {error!r}"
        if tokens != want:
            yield "token", (f"request {i} (prompt of {len(it.prompt)} tokens) produced "
                            f"{_short(tokens)}, the oracle {_short(want)}")
    else:
        if error is None:
            yield "lifecycle", f"request {i} ended ({kind}) without an error"
        if tokens != want[:len(tokens)]:
            yield "token", (f"request {i} ({kind}) emitted {_short(tokens)} before it ended, "
                            f"not a prefix of the oracle's {_short(want)}")


def _short(tokens: list[int]) -> str:
    return str(tokens) if len(tokens) <= 12 else f"[{', '.join(map(str, tokens[:12]))}, ...]"

