"""atom-core's steps as vllm-rbln 0.12.0's own `RBLNSchedulerOutput` (atom_core/vllm/rbln.py):
built from the torch-free Scheduler's calls on an RBLN-shaped configuration (a reserved scratch
block, the prefix cache, one chunk per prefill, decode over every lane), with vllm-rbln's class
from its wheel (unpacked by `make vllm-venv`, not installed: see the Makefile)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

RBLN_DIR = Path(sys.prefix) / "vllm-rbln"
sys.path.insert(0, str(RBLN_DIR))

from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm_rbln.v1.core.optimum_scheduler import RBLNSchedulerOutput  # noqa: E402

from atom_core.config import Config  # noqa: E402
from atom_core.scheduler import Scheduler  # noqa: E402
from atom_core.scheduler.records import CopyWork, DecodeCall, PrefillCall, StepResult  # noqa: E402
from atom_core.vllm.rbln import NotExpressible, rbln_fields, rbln_output  # noqa: E402

BLOCK = 128
CONFIG = Config(lanes=2, kv_blocks=10, block_size=BLOCK, max_seq_len=4 * BLOCK,
                prefill_chunk=BLOCK, prefix_cache=True, scratch="reserved")


def vid(rid: int) -> str:
    return f"req-{rid}"


def step(s: Scheduler, seen: list[tuple[Any, list[CopyWork], Any]],
         pending: dict[int, list[CopyWork]]) -> None:
    """One step; each call's RBLNSchedulerOutput (or the refusal) appended to `seen`. Copies
    wait in `pending` (per lane) for their lane's prefill, as the runner makes them."""
    out = s.schedule()
    while not out.done:
        if out.call is None:
            for w in out.work:
                if isinstance(w, CopyWork):
                    pending.setdefault(w.lane, []).append(w)
            out = s.update(StepResult(work=(None,) * len(out.work)))
            continue
        call = out.call
        copies = pending.pop(call.lane, []) if isinstance(call, PrefillCall) else []
        try:
            built = rbln_output(SchedulerOutput.make_empty(),
                                rbln_fields(call, copies, vid), RBLNSchedulerOutput)
        except NotExpressible as e:
            built = e
        seen.append((call, copies, built))
        rows = len(call.ids) if isinstance(call, DecodeCall) else 1
        out = s.update(StepResult(tokens=(5,) * rows))


def run(s: Scheduler) -> list[tuple[Any, list[CopyWork], Any]]:
    seen: list[tuple[Any, list[CopyWork], Any]] = []
    pending: dict[int, list[CopyWork]] = {}
    for _ in range(200):
        if not s.busy():
            return seen
        step(s, seen, pending)
    raise AssertionError("the scheduler did not go idle")


def test_prefills_and_decodes_carry_the_cores_tables_pad_and_lanes() -> None:
    """Prompts of one chunk (the runner prefills a prompt in one call), the second one a hit on
    the first one's whole first block: every step is expressible and carries the core's
    tables, copies, padding target and lanes."""
    s = Scheduler(CONFIG)
    shared = list(range(3, 3 + BLOCK))
    a = s.submit(shared, 3)
    seen = run(s)
    b = s.submit(shared + list(range(300, 310)), 3)  # its first block is a's: a prefix hit
    c = s.submit(list(range(600, 700)), 40)  # decodes beside b
    seen += run(s)
    kinds = set()
    for call, copies, out in seen:
        assert isinstance(out, RBLNSchedulerOutput), out
        # vLLM's own fields come through untouched
        assert dataclasses.fields(out)[0].name == "scheduled_new_reqs"
        for table in out.block_table_dict.values():
            assert table.dtype == torch.int16 and len(table) == CONFIG.blocks_per_table
        if isinstance(call, PrefillCall):
            kinds.add("prefill-hit" if copies else "prefill")
            v = vid(call.request)
            assert out.block_table_dict[v].tolist() == list(call.table)
            assert out.cache_slot_id_dict == {v: call.lane} and out.dummy_block is None
            assert out.cached_block_table == [c.src for c in copies]
            assert sum(out.cached_length) == call.start  # the runner starts after the copies
        else:
            kinds.add("decode")
            assert out.dummy_block == call.pad == CONFIG.kv_blocks - 1  # the reserved scratch
            assert set(out.cache_slot_id_dict.values()) == set(call.lanes)
            for v, lane in out.cache_slot_id_dict.items():
                assert out.block_table_dict[v].tolist() == list(call.tables[lane])
                assert CONFIG.kv_blocks - 1 not in call.tables[lane]  # never a live row's block
    assert kinds == {"prefill", "prefill-hit", "decode"}
    assert s.requests[a].tokens == [5] * 3 and s.requests[b].tokens == [5] * 3
    assert s.requests[c].tokens == [5] * 40


def test_a_prompts_later_chunk_is_refused_by_name() -> None:
    """atom-core prefills one chunk per step; vllm-rbln's runner takes a request's second
    chunk for a decode, so that step has no expression (docs/VLLM_RBLN.md 3.4)."""
    s = Scheduler(CONFIG)
    s.submit(list(range(3, 3 + BLOCK + 40)), 2)
    outs = [out for _, _, out in run(s)]
    refused = [o for o in outs if isinstance(o, NotExpressible)]
    assert len(refused) == 1 and "from position 128" in str(refused[0])
    assert "whole prompt in one call" in str(refused[0])
    assert sum(isinstance(o, RBLNSchedulerOutput) for o in outs) == len(outs) - 1


def test_without_vllm_rbln_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm_rbln.v1.core.optimum_scheduler", None)
    with pytest.raises(ModuleNotFoundError, match="make vllm-venv"):
        rbln_output(SchedulerOutput.make_empty(),
                    rbln_fields(_a_prefill(), [], vid))


def _a_prefill() -> PrefillCall:
    s = Scheduler(CONFIG)
    s.submit([3, 4, 5], 1)
    out = s.schedule()
    while out.call is None:
        out = s.update(StepResult(work=(None,) * len(out.work)))
    assert isinstance(out.call, PrefillCall)
    return out.call
