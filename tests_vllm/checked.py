"""`AtomScheduler` that checks the core's invariants after every call vLLM makes into it,
and remembers its instances so a test can look at it when the engine is idle."""

from __future__ import annotations

from typing import Any

from atom_core.vllm.scheduler import AtomScheduler


class CheckedAtomScheduler(AtomScheduler):
    instances: list[CheckedAtomScheduler] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0
        # (prompt chunks, decode rows) of each step, read off vLLM's own SchedulerOutput
        self.shapes: set[tuple[int, int]] = set()
        CheckedAtomScheduler.instances.append(self)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        self.check_invariants()
        n = list(out.num_scheduled_tokens.values())
        self.shapes.add((sum(1 for x in n if x > 1), sum(1 for x in n if x == 1)))
        return out

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        out = super().update_from_output(*args, **kwargs)
        self.check_invariants()
        self.steps += 1
        return out

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        out = super().finish_requests(*args, **kwargs)
        self.check_invariants()
        return out

    def idle(self) -> list[str]:
        """What is still held (nothing, when the engine has no request): lanes, blocks
        other than free or cache entries, requests."""
        d = self.core.describe()
        held = [f"lane {ln['lane']} holds request {ln['request']}" for ln in d["lanes"]
                if ln["request"] is not None]
        held += [f"block {b} is {own}" for b, own in enumerate(d["blocks"])
                 if own not in ("free", "cache")]
        held += [f"request {v} is live" for v in self.requests]
        held += [f"request {r} waits in the core" for r in d["waiting"]]
        return held
