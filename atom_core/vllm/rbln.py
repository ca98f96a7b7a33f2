"""atom-core's step as vllm-rbln 0.12.0's scheduler output (docs/VLLM_RBLN.md).

vllm-rbln's optimum model runner reads vLLM's `SchedulerOutput` plus five fields of its own
`RBLNSchedulerOutput`: each request's block table in compiled ids, the prefix-cache copies of a
prefill as sources and lengths, the decode padding rows' block, and each request's row in the
per-sequence device caches. `rbln_fields` derives them from one step of
`atom_core.scheduler.Scheduler` (its call and the copies before it) as plain data;
`rbln_output` builds vllm-rbln's own type from them, importing vllm-rbln (and torch) only then.

What vllm-rbln's runner cannot be told is refused here by name rather than sent wrong: it copies
the i-th cached source into the i-th block of the table and starts the prefill after the copied
tokens, so a copy into a later block (a hit while the table grows) or a prefill that starts
past its copies (an adopted cache entry) has no field (docs/VLLM_RBLN.md, 3.4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from atom_core.scheduler.records import CopyWork, DecodeCall, PrefillCall

# the vllm-rbln release these fields are read from (its wheel's RBLNSchedulerOutput)
VLLM_RBLN_VERSION = "0.12.0"


class NotExpressible(ValueError):
    """A step vllm-rbln 0.12.0's optimum runner has no field for (see the module doc)."""


@attrs.frozen
class RblnFields:
    """The five fields, as plain ints: block tables in compiled ids (the core's: no null block
    on this path), `dummy_block` the decode's padding target (None for a prefill)."""

    block_table_dict: dict[str, tuple[int, ...]]
    cached_block_table: list[int]
    cached_length: list[int]
    dummy_block: int | None
    cache_slot_id_dict: dict[str, int]


def rbln_fields(call: PrefillCall | DecodeCall, copies: Sequence[CopyWork],
                request_id: Callable[[int], str]) -> RblnFields:
    """The fields for `call`, the step's forward. `copies`: for a prefill, the `CopyWork`s into
    its lane's table since the lane was admitted (done, not yet sent: the runner makes them
    with the prefill; the core may make them over several steps, one block at a time); for a
    decode, none. `request_id` names a core request as the engine does."""
    if isinstance(call, PrefillCall):
        vid = request_id(call.request)
        mine = [c for c in copies if c.lane == call.lane]
        if len(mine) != len(copies):
            raise NotExpressible("copies for a lane that does not prefill this step: the "
                                 "optimum runner copies only for the request it prefills")
        if not mine and call.start > 0:
            raise NotExpressible(
                f"a prompt's chunk from position {call.start}: the optimum runner prefills a "
                "request's whole prompt in one call (chunking inside the compiled prefill) and "
                "takes a later chunk of the same request for a decode")
        for i, c in enumerate(mine):
            if call.table[i] != c.dst:
                raise NotExpressible(
                    f"a prefix copy into block {c.dst}, entry {i} of the table "
                    f"{list(call.table)}: the optimum runner copies the i-th source into the "
                    "i-th block only (a hit while the table grows has no field)")
        if sum(c.n for c in mine) != call.start:
            raise NotExpressible(
                f"a prefill that starts at {call.start} after {sum(c.n for c in mine)} copied "
                "tokens: the optimum runner starts a prefill after its copies (an adopted "
                "cache entry has no field)")
        return RblnFields({vid: call.table}, [c.src for c in mine], [c.n for c in mine], None,
                          {vid: call.lane})
    if copies:
        raise NotExpressible("prefix copies before a decode call: the optimum runner copies "
                             "only before a prefill")
    rows = {request_id(call.requests[ln]): ln for ln in call.lanes}  # type: ignore[arg-type]
    return RblnFields({vid: call.tables[ln] for vid, ln in rows.items()}, [], [], call.pad,
                      rows)


def rbln_output(base: Any, fields: RblnFields, output_cls: type | None = None) -> Any:
    """vllm-rbln's `RBLNSchedulerOutput`: every field of `base` (vLLM's `SchedulerOutput` for
    the same step) and `fields`, block tables as int16 tensors (the graphs' dtype).
    `output_cls`: the class to build (default: vllm-rbln's, imported now)."""
    import torch

    if output_cls is None:
        try:
            from vllm_rbln.v1.core.optimum_scheduler import RBLNSchedulerOutput as output_cls
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                f"rbln_output needs vllm-rbln {VLLM_RBLN_VERSION} importable ({e}); "
                "`make vllm-venv` unpacks it beside vLLM for the tests") from None
    own = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return output_cls(
        **own,
        block_table_dict={v: torch.tensor(t, dtype=torch.int16)
                          for v, t in fields.block_table_dict.items()},
        cached_block_table=list(fields.cached_block_table),
        cached_length=list(fields.cached_length), dummy_block=fields.dummy_block,
        cache_slot_id_dict=dict(fields.cache_slot_id_dict))
