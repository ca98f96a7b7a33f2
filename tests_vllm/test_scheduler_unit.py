"""AtomScheduler driven directly through vLLM's scheduler interface, with vLLM's own types (its
VllmConfig, KVCacheConfig, Request and ModelRunnerOutput) and no model: the cases an engine
makes rare (a client's abort while a step's forward is out), its stats, and what it refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checked import CheckedAtomScheduler
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 64


def build(model: Path, blocks: int = 24, **engine: Any) -> CheckedAtomScheduler:
    cfg = EngineArgs(model=str(model), max_num_seqs=4, max_model_len=256, block_size=BLOCK,
                     dtype="float32", enforce_eager=True, **engine).create_engine_config()
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                             dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return CheckedAtomScheduler(vllm_config=cfg, kv_cache_config=kv,
                                structured_output_manager=StructuredOutputManager(cfg),
                                block_size=BLOCK, log_stats=True)


def request(rid: str, n: int, max_tokens: int = 8) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, eos_token_id=2)
    return Request(rid, list(range(3, 3 + n)), params, None)


def ran(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """What the runner returns for `out`: a token for each request whose prompt this step
    finishes or which decodes, nothing for a chunk in the middle of a prompt."""
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[token] for _ in ids])


def test_an_abort_while_the_forward_is_out_lands_after_it(tiny_llama: Path) -> None:
    s = build(tiny_llama)
    a, b = request("a", 10), request("b", 12)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    # the client aborts "a" while the step's forward runs
    assert s.finish_requests("a", RequestStatus.FINISHED_ABORTED) == [a]
    outs = s.update_from_output(out, ran(out))
    got = {o.request_id: o for o in outs[0].outputs}
    assert "a" not in got  # the client ended it: no token for it, no second end
    assert got["b"].new_token_ids == [7] and a.is_finished() and not b.is_finished()
    assert s.get_num_unfinished_requests() == 1
    nxt = s.schedule()
    assert nxt.finished_req_ids == {"a"}  # the runner frees its state
    assert list(nxt.num_scheduled_tokens) == ["b"]
    s.update_from_output(nxt, ran(nxt))
    s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert s.idle() == [] and not s.has_unfinished_requests()


def test_stats_read_the_cores_numbers(tiny_llama: Path) -> None:
    s = build(tiny_llama, enable_prefix_caching=True)
    for i in range(3):
        s.add_request(request(f"r{i}", 70 + i))
    out = s.schedule()
    outs = s.update_from_output(out, ran(out))
    stats = outs[0].scheduler_stats
    assert stats.num_running_reqs == 3 and stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == pytest.approx(s.get_kv_cache_usage())
    assert stats.kv_cache_usage > 0
    assert stats.prefix_cache_stats.requests == 3 and stats.prefix_cache_stats.queries > 0


def test_a_request_the_core_refuses_ends_alone_with_an_error(tiny_llama: Path) -> None:
    s = build(tiny_llama)
    s.add_request(request("long", 300))  # max_model_len 256
    s.add_request(request("ok", 5))
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["ok"]
    outs = {o.request_id: o for o in s.update_from_output(out, ran(out))[0].outputs}
    assert outs["long"].finish_reason is not None and outs["long"].new_token_ids == []
    assert str(outs["long"].finish_reason) in ("error", "FinishReason.ERROR")
    assert outs["ok"].new_token_ids == [7]


def test_what_it_does_not_model_is_refused_by_name(tiny_llama: Path) -> None:
    # (async scheduling is refused the same way; vLLM's CPU platform turns it off itself)
    with pytest.raises(ValueError, match=r"AtomScheduler does not support LoRA \(drop "
                                         r"--enable-lora\)"):
        build(tiny_llama, enable_lora=True)
