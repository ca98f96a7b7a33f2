"""What a run records: its events (`SimEvent`, replayed exactly) and its failures."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class SimEvent:
    """One recorded decision: `submit`, `step` (a tick) or a fault kind's event."""

    kind: str
    args: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, kind: str, **args: Any) -> SimEvent:
        return cls(kind, tuple(args.items()))

    def arg(self, name: str) -> Any:
        return dict(self.args)[name]

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, **dict(self.args)}

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(f'{k}={v}' for k, v in self.args)})"


@attrs.frozen
class Failure:
    """A check that failed at a tick (or a crash): a run stops at its first."""

    kind: str  # "invariant" | "leak" | "token" | "lifecycle" | "drain" | "crash"
    tick: int
    detail: str

    def __str__(self) -> str:
        return f"tick {self.tick}: {self.kind}: {self.detail}"
