"""AtomScheduler against vLLM's own scheduler, in vLLM's CPU engine on the same runner and model:
`make bench-vllm` (runs in the vLLM venv; never in CI).

The same greedy workload (prompts of 32-200 tokens, 64 output tokens each; the issue-50 shape)
goes through vLLM's offline engine twice per round, once per scheduler, alternated over
`--rounds` rounds, at each concurrency (the number of requests submitted at once, with
max_num_seqs 16). Reported per concurrency, as medians over rounds: output tokens/s of each and
their ratio (atom / vLLM), and each scheduler's own CPU per engine step: the thread CPU time
inside `schedule()` and `update_from_output()` (vLLM runs other threads beside them), measured
by a subclass of each that times those two calls and nothing else. Every round checks that both
schedulers produced the same tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler  # noqa: E402

from atom_core.vllm.scheduler import AtomScheduler  # noqa: E402


def _timed(base: type) -> type:
    """`base` with the thread CPU time inside `schedule()` and `update_from_output()` added up
    (`cpu`) and the steps counted (`steps`)."""
    def clocked(name: str, counts_step: bool) -> Any:
        inner = getattr(base, name)

        def call(self: Any, *a: Any, **k: Any) -> Any:
            t = time.thread_time()
            try:
                return inner(self, *a, **k)
            finally:
                timed.cpu += time.thread_time() - t
                timed.steps += counts_step

        return call

    timed = type(f"Timed{base.__name__}", (base,), {
        "cpu": 0.0, "steps": 0, "schedule": clocked("schedule", False),
        "update_from_output": clocked("update_from_output", True)})
    return timed


def save_model(path: Path) -> None:
    """A 26M-parameter random Llama (hidden 512, 6 layers, 8 query / 4 KV heads, vocab 8192)."""
    import torch
    import transformers as hf

    torch.manual_seed(0)
    hf.LlamaForCausalLM(hf.LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        tie_word_embeddings=False)).eval().save_pretrained(path)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests_vllm"))
    from conftest import save_tiny_llama  # (its word-level tokenizer, 512 words)

    tok_dir = Path(tempfile.mkdtemp())
    save_tiny_llama(tok_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (path / f).write_bytes((tok_dir / f).read_bytes())


def workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(32, 200))] for _ in range(n)]


def alternated(c: int, rounds: int,
               runs: dict[str, Callable[[list[list[int]]], dict[str, Any]]]
               ) -> dict[str, list[dict[str, Any]]] | None:
    """Each of `runs` (name -> a run of one workload) on the same `c` prompts per round, the
    order reversed every other round; each run's dict per name, in rounds. None (and a line on
    stderr) when two runs of a round gave different `tokens`."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    order = list(runs.items())
    for r in range(rounds):
        prompts = workload(c, seed=r)
        for name, go in order if r % 2 == 0 else order[::-1]:
            rows[name].append(go(prompts))
        if len({json.dumps(v[-1]["tokens"], sort_keys=True) for v in rows.values()}) > 1:
            print(f"concurrency {c} round {r}: the schedulers' tokens differ", file=sys.stderr)
            return None
    return rows


def run(model: Path, scheduler: type, prompts: list[list[int]], blocks: int) -> dict[str, Any]:
    scheduler.cpu, scheduler.steps = 0.0, 0  # type: ignore[attr-defined]
    llm = LLM(model=str(model), max_num_seqs=16, max_model_len=512, block_size=128,
              enforce_eager=True, dtype="float32", seed=0, enable_prefix_caching=False,
              scheduler_cls=scheduler, num_gpu_blocks_override=blocks)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    # (warm-up: the first forward of an engine pays for lazy initialisation)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)
    scheduler.cpu, scheduler.steps = 0.0, 0  # type: ignore[attr-defined]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    steps = max(scheduler.steps, 1)  # type: ignore[attr-defined]
    return {"tokens": tokens, "tok_s": sum(map(len, tokens)) / wall,
            "sched_us_per_step": 1e6 * scheduler.cpu / steps,  # type: ignore[attr-defined]
            "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    model = Path(tempfile.mkdtemp()) / "small-llama"
    save_model(model)
    ours, theirs = _timed(AtomScheduler), _timed(VllmScheduler)
    blocks = 16 * 4 + 8  # every lane's whole table (512 / 128) and some to spare
    report = []
    for c in args.concurrency:
        rows = alternated(c, args.rounds, {
            "vllm": lambda p: run(model, theirs, p, blocks),
            "atom": lambda p: run(model, ours, p, blocks)})
        if rows is None:
            return 1
        med = {n: {k: statistics.median(x[k] for x in v)
                   for k in ("tok_s", "sched_us_per_step", "steps")} for n, v in rows.items()}
        ratio = statistics.median(a["tok_s"] / v["tok_s"]
                                  for a, v in zip(rows["atom"], rows["vllm"], strict=True))
        report.append({"concurrency": c, "vllm": med["vllm"], "atom": med["atom"],
                       "throughput_ratio": ratio})
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{'conc':>5} {'vLLM tok/s':>11} {'atom tok/s':>11} {'ratio':>6} "
              f"{'vLLM us/step':>13} {'atom us/step':>13} {'steps v/a':>10}")
        for row in report:
            v, a = row["vllm"], row["atom"]
            print(f"{row['concurrency']:>5} {v['tok_s']:>11.1f} {a['tok_s']:>11.1f} "
                  f"{row['throughput_ratio']:>6.2f} {v['sched_us_per_step']:>13.0f} "
                  f"{a['sched_us_per_step']:>13.0f} {v['steps']:>5.0f}/{a['steps']:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
