"""A hybrid sliding-window model (a tiny random Gemma3: three sliding-window KV cache groups and
one full-attention group) under `AtomScheduler`: in vLLM's own engine every request's tokens
equal those of vLLM's own scheduler and of transformers' `generate()`, also with preemption at
the proved minimum; driven directly, each sliding group's table is the lane's ring (its blocks
its own, apart from the core's and from every other ring); what it cannot serve is refused by
name."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from checked import CheckedAtomScheduler
from conftest import GEMMA_WINDOW
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams as Params
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from atom_core.config import ConfigError, min_kv_blocks
from atom_core.vllm.config import ring_blocks

ATOM = CheckedAtomScheduler
SEQS, MAX_LEN, BLOCK = 4, 256, 64
T = MAX_LEN // BLOCK
SLIDING = 3  # the tiny Gemma3's sliding-window groups
RING = ring_blocks(GEMMA_WINDOW, BLOCK, BLOCK)
LANES = SEQS + 1  # the hybrid Config's lanes: one kept idle (its local slot takes padding)
RINGS = SLIDING * LANES * RING
# the proved minimum with preemption (T + 1 core blocks), the rings and vLLM's null block
MIN_BLOCKS = min_kv_blocks(LANES, False, "dynamic", T, True) + RINGS + 1
BLOCKS = SEQS * T + 8 + RINGS + 1


def prompts() -> list[list[int]]:
    """More requests than lanes, prompts of 9 to about 190 tokens: past the window (16), most
    past a chunk (64), some past two."""
    return [[(13 * i + 7 * j) % 500 + 3 for j in range(9 + (37 * i) % 181)] for i in range(10)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(llm: LLM, ps: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def engines(tiny_gemma3: Path) -> Iterator[dict[Any, LLM]]:
    """The engine for (scheduler, blocks), built when asked for, one at a time (see
    test_engine.py)."""

    class Engines(dict):  # type: ignore[type-arg]
        def __missing__(self, key: Any) -> LLM:
            self.clear()
            gc.collect()
            scheduler, blocks = key
            self[key] = LLM(model=str(tiny_gemma3), max_num_seqs=SEQS, max_model_len=MAX_LEN,
                            block_size=BLOCK, enforce_eager=True, dtype="float32", seed=0,
                            enable_prefix_caching=False, scheduler_cls=scheduler,
                            num_gpu_blocks_override=blocks)
            return self[key]

    built = Engines()
    yield built
    built.clear()
    gc.collect()


@pytest.fixture(scope="module")
def vllms_tokens(engines: dict) -> dict[str, list]:
    """vLLM's own scheduler's tokens for both workloads below (one engine for both)."""
    ps = prompts()
    long = [p for p in ps if len(p) > 100][:3]
    out = run(engines[None, BLOCKS], ps + long, [greedy(1 + (7 * i) % 40) for i in range(len(ps))]
              + [greedy(24)] * len(long))
    return {"mixed": out[:len(ps)], "long": out[len(ps):]}


def test_hybrid_greedy_tokens_equal_vllms_scheduler_and_generate(
        engines: dict, vllms_tokens: dict, tiny_gemma3: Path) -> None:
    import transformers as hf

    ps = prompts()
    ours = run(engines[ATOM, BLOCKS], ps, [greedy(1 + (7 * i) % 40) for i in range(len(ps))])
    assert ours == vllms_tokens["mixed"]
    sched = CheckedAtomScheduler.instances[-1]
    assert sched.config.sliding_window == GEMMA_WINDOW and sched.config.lanes == LANES
    assert sched.steps > 0
    assert sched.config.kv_blocks == BLOCKS - 1 - RINGS  # what the rings leave
    assert sched.idle() == []
    # steps that computed several prompt chunks beside decodes: the spare lane's local slot
    # takes the decode's padding, so decode does not wait for prefills
    assert any(chunks >= 2 and decodes >= 1 for chunks, decodes in sched.shapes)
    assert max(chunks + decodes for chunks, decodes in sched.shapes) == SEQS
    model = hf.Gemma3ForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    for p, got in zip(ps[:5], ours[:5], strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), max_new_tokens=len(got), do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got == want


def test_hybrid_preemption_at_the_proved_minimum_is_exact(engines: dict,
                                                          vllms_tokens: dict) -> None:
    """T + 1 core blocks beside the rings: lanes grow into each other and are preempted, and
    each preempted request recomputes its sliding KV into the ring of the lane it resumes in."""
    long = [p for p in prompts() if len(p) > 100][:3]  # each grows to three blocks or four
    ours = run(engines[ATOM, MIN_BLOCKS], long, greedy(24))
    assert ours == vllms_tokens["long"]
    sched = CheckedAtomScheduler.instances[-1]
    assert sched.config.kv_blocks == T + 1
    assert sched.core.stats.preemptions > 0 and sched.idle() == []


# ------------------------------------------------------------------ driven directly, no model
def build(model: Path, blocks: int = BLOCKS, window: int = GEMMA_WINDOW,
          **engine: Any) -> CheckedAtomScheduler:
    """AtomScheduler over vLLM's config of the tiny Gemma3 and its four groups (as vLLM's
    engine builds them: sliding x3, then full attention), with `blocks` blocks."""
    cfg = EngineArgs(model=str(model), max_num_seqs=SEQS, max_model_len=MAX_LEN,
                     block_size=BLOCK, dtype="float32", enforce_eager=True,
                     **{"enable_prefix_caching": False, **engine}).create_engine_config()
    dims: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 32,
                            "dtype": torch.float32}
    groups = [KVCacheGroupSpec([f"layer{i}"], SlidingWindowSpec(
        sliding_window=window if i else GEMMA_WINDOW, **dims)) for i in range(SLIDING)]
    groups.append(KVCacheGroupSpec(["layer3"], FullAttentionSpec(**dims)))
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    from vllm.v1.structured_output import StructuredOutputManager

    return CheckedAtomScheduler(vllm_config=cfg, kv_cache_config=kv,
                                structured_output_manager=StructuredOutputManager(cfg),
                                block_size=BLOCK)


def request(rid: str, n: int, max_tokens: int) -> Request:
    params = Params(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, eos_token_id=2)
    return Request(rid, [(5 * j + len(rid)) % 500 + 3 for j in range(n)], params, None)


def ran(out: SchedulerOutput) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids])


def test_each_sliding_table_is_the_lanes_own_ring(tiny_gemma3: Path) -> None:
    """What the runner is told, read off vLLM's SchedulerOutput as its runner reads it (new
    requests' tables, appended entries, resumed requests' tables replaced): each sliding
    group's table repeats R blocks of its own; no two running requests, and no two groups,
    share a sliding block; no sliding block is one of the core's (the full group's)."""
    s = build(tiny_gemma3, blocks=MIN_BLOCKS)
    for i in range(7):
        s.add_request(request(f"r{i}", 70 + 17 * i, 80))
    tables: dict[str, list[list[int]]] = {}
    preempted = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        for new in out.scheduled_new_reqs:
            tables[new.req_id] = [list(ids) for ids in new.block_ids]
        c = out.scheduled_cached_reqs
        for vid, ids in zip(c.req_ids, c.new_block_ids, strict=True):
            if vid in c.resumed_req_ids:
                preempted += 1
                tables[vid] = [list(g) for g in ids]
            elif ids is not None:
                for have, more in zip(tables[vid], ids, strict=True):
                    have.extend(more)
        live = [tables[v] for v in out.num_scheduled_tokens]
        core_ids = range(1, s.config.kv_blocks + 1)
        seen: set[int] = set()
        for groups in live:
            *sliding, full = groups
            assert all(b in core_ids for b in full)
            for ring in sliding:
                assert len(ring) == len(full)
                assert ring == [ring[i % RING] for i in range(len(ring))]
                own = set(ring)
                assert len(own) == min(RING, len(ring)) and not own & seen
                assert all(b not in core_ids and 0 < b < MIN_BLOCKS for b in own)
                seen |= own
        s.update_from_output(out, ran(out))
    assert preempted > 0 and s.core.stats.preemptions > 0
    assert s.idle() == []


def test_below_the_proved_minimum_the_rings_and_the_rule_are_named(tiny_gemma3: Path) -> None:
    with pytest.raises(ConfigError) as e:
        build(tiny_gemma3, blocks=MIN_BLOCKS - 1)
    msg = str(e.value)
    assert f"{RINGS} the sliding layers' rings ({SLIDING} groups x {LANES} lanes, one spare, " \
        f"x {RING} blocks)" in msg
    assert "rule 'dynamic-scratch-preemption" in msg and f"needs {T + 1}" in msg
    assert f"--num-gpu-blocks-override {MIN_BLOCKS}" in msg
    assert build(tiny_gemma3, blocks=MIN_BLOCKS).config.kv_blocks == T + 1


def test_what_a_hybrid_model_cannot_have_is_refused_by_name(tiny_gemma3: Path) -> None:
    with pytest.raises(ConfigError, match=r"--enable-prefix-caching with a hybrid "
                                          r".*give --no-enable-prefix-caching"):
        build(tiny_gemma3, enable_prefix_caching=True)
    with pytest.raises(ValueError, match=r"sliding windows of different sizes \[16, 32\]"):
        build(tiny_gemma3, window=32)
