"""What the machine reports: each check's failure is its own exception, so a test (and the
mutation harness) can tell which check caught a planted bug."""

from __future__ import annotations

from typing import Any


class InvariantViolation(AssertionError):
    """A step of the core led to a state (or transition) the spec's invariants forbid."""

    def __init__(self, kind: str, names: list[str], action: str, args: tuple[Any, ...],
                 core: Any, pre: Any, post: Any) -> None:
        self.kind, self.names, self.action, self.args = kind, names, action, args
        super().__init__(
            f"{kind} {names} violated by {action}{args}\n"
            f"pre:  {core.describe_state(pre)}\npost: {core.describe_state(post)}")


class LifecycleDivergence(AssertionError):
    """The core accepted or refused a step against the lifecycle model's prediction (a guard
    no invariant protects, e.g. one that only rejects late events)."""

    def __init__(self, action: str, args: tuple[Any, ...], expected: str | None,
                 got: str | None) -> None:
        self.action, self.args, self.expected, self.got = action, args, expected, got
        super().__init__(f"{action}{args}: the lifecycle model expects "
                         f"{'acceptance' if expected is None else expected!r}, "
                         f"the core {'accepted' if got is None else f'rejected ({got})'}")


class ProgressViolation(AssertionError):
    """A quiescent state at or above the proved capacity in which a progress property fails
    (e.g. an idle lane and a waiting request that no admission accepts)."""

    def __init__(self, names: list[str], action: str, args: tuple[Any, ...], core: Any,
                 state: Any) -> None:
        self.names, self.action, self.args = names, action, args
        super().__init__(f"progress {names} fails after {action}{args}\n"
                         f"state: {core.describe_state(state)}")


class RefinementViolation(AssertionError):
    """The policy chose a step the spec refuses, or declined (or missed) one the spec allows
    where it must not."""

    def __init__(self, action: str, what: str, core: Any, state: Any) -> None:
        self.action = action
        super().__init__(f"policy refinement ({action}): {what}\n"
                         f"state: {core.describe_state(state)}")


class ModelDivergence(AssertionError):
    """After a step the core applied as the lifecycle model predicted, its state differs from
    the model's (`Life.compare`): an update the spec makes (a key, an owner, a snapshot
    boundary) that the core made otherwise, or not at all."""

    def __init__(self, action: str, args: tuple[Any, ...], detail: str) -> None:
        self.action, self.args = action, args
        super().__init__(f"after {action}{args} the core's state differs from the lifecycle "
                         f"model's: {detail}")


class MirrorDivergence(AssertionError):
    """The ghost-off core disagrees with the ghost-on core on a step."""

    def __init__(self, what: str, action: str, args: tuple[Any, ...], on: Any, off: Any) -> None:
        self.what = what
        super().__init__(f"ghost-off core differs in {what} after {action}{args}: "
                         f"on={on!r} off={off!r}")
