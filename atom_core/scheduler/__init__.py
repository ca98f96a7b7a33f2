"""Scheduler: the core state, the policy and the scheduling loop, written once; no runtime.

A step is `schedule()` and then `update()` until the output says the step is done. The loop
(lanes grow, waiting requests are admitted, lanes grow again, then one prefill chunk or one
decode call) asks the outside world for block work (`CopyWork`, `StoreWork`, `LoadWork`,
`SnapshotWork`) and for the forward call (`PrefillCall`, `DecodeCall`) as plain data: ints,
tuples, no tensors. Whoever runs the model (`AtomBatcher`, the executor over a `Runtime`; an
engine) runs what a `StepOutput` asks and reports back with a `StepResult`.

Block work is asked one item at a time, as the loop reaches it, and the loop resumes with its
outcome: a failed copy frees its lane, a store frees its block, before the next choice is made,
exactly where the adapter that ran them inline made them. So an output asks for work or for the
call, never both, and `update()` answers with the next output; the last one is `done` and
carries the step's events. (Deferring every outcome to the end of the step, as an asynchronous
engine would, changes which choices a step makes: a behaviour change, not a refactoring.)

Nothing here imports torch: the module is the part of serving the proofs speak about, and an
engine that computes logits elsewhere drives it with no runtime object at all.

    records  what crosses (StepOutput, StepResult, the work, the calls) and Request, Stats, Event
    loop     Scheduler: the step's loop, the client calls, the core's part of PD
"""

from atom_core.scheduler.loop import Scheduler
from atom_core.scheduler.records import (
    Call,
    CopyWork,
    CoreRejected,
    DecodeCall,
    Event,
    InvariantViolation,
    LoadWork,
    MixedCall,
    PrefillCall,
    Request,
    Result,
    SnapshotWork,
    Stats,
    StepOutput,
    StepResult,
    StoreWork,
    Work,
    as_integer,
    as_token,
)

__all__ = [
    "Call", "CopyWork", "CoreRejected", "DecodeCall", "Event", "InvariantViolation", "LoadWork",
    "MixedCall", "PrefillCall", "Request", "Result", "Scheduler", "SnapshotWork", "Stats",
    "StepOutput", "StepResult", "StoreWork", "Work", "as_integer", "as_token",
]
