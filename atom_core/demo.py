"""`atom-core demo`: serve a built-in workload through `AtomBatcher` on the torch reference runtime
(or, with `--runtime hf`, on a transformers model checked against its own `generate`).

The workload has more requests than lanes; most share a long system prompt (so later ones are
prefix hits once an earlier one is cached), a few are unrelated. Every request is then checked
against the cache-free oracle (`TorchReferenceRuntime.generate`): the reference runtime's
arithmetic is exact, so a correct scheduler reproduces the oracle's tokens bit for bit.

`Oracle` (memoised `generate`) and `oracle_for` are shared with the tests.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

import attrs
import torch

from atom_core.batcher import AtomBatcher, Result
from atom_core.config import Config, min_kv_blocks
from atom_core.runtime import registry
from atom_core.runtime.reference import TorchReferenceRuntime
from atom_core.runtime.registry import RuntimeRequest

MAX_SEQ_LEN = 256
PREFILL_CHUNK = 64
SYSTEM_TOKENS = 160  # the shared system prompt: two whole chunks and part of a third
SHARED_FRACTION = 0.8  # requests that start with the system prompt
MODEL_SEED = 0


# --------------------------------------------------------------------------- the oracle
class Oracle:
    """`runtime.generate` memoised by prompt: greedy decoding by full recompute, no KV cache.

    A continuation is computed once, as long as any caller has asked for, and cut for each call:
    `generate(p, n, eos)` equals the first `n` tokens of a longer run, cut after the first
    `eos` (the oracle's own stopping rules), so the cut is exactly what `generate` returns.
    """

    def __init__(self, runtime: TorchReferenceRuntime) -> None:
        self.runtime = runtime
        self._memo: dict[tuple[int, ...], list[int]] = {}
        self.calls = 0  # `generate` calls actually run

    def generate(self, prompt: Sequence[int], max_new_tokens: int,
                 eos_token_id: int | None = None) -> list[int]:
        key = tuple(int(t) for t in prompt)
        # the oracle emits at most max_seq_len - len(prompt) + 1 tokens (see `generate`)
        need = min(max_new_tokens, self.runtime.max_seq_len - len(key) + 1)
        have = self._memo.get(key)
        if have is None or len(have) < need:
            self.calls += 1
            have = self.runtime.generate(list(key), need)
            self._memo[key] = have
        out = have[:max_new_tokens]
        if eos_token_id is not None and eos_token_id in out:
            out = out[:out.index(eos_token_id) + 1]
        return list(out)


_ORACLES: dict[Any, Oracle] = {}


def oracle_for(runtime: TorchReferenceRuntime) -> Oracle:
    """The shared memoised oracle of `runtime`'s model (its weights, dtype and max_seq_len), on a
    runtime of its own (one block, one lane: the oracle never touches a KV cache)."""
    spec = attrs.evolve(runtime.spec, num_blocks=1, batch_size=1, decoder_batch_sizes=(1,))
    key = (spec, runtime.seed, runtime.dtype)
    if key not in _ORACLES:
        _ORACLES[key] = Oracle(TorchReferenceRuntime(spec, seed=runtime.seed,
                                                     dtype=runtime.dtype))
    return _ORACLES[key]


# --------------------------------------------------------------------------- the workload
@attrs.frozen
class Item:
    prompt: list[int]
    max_new_tokens: int
    shared: bool  # starts with the system prompt


def workload(requests: int, max_new_tokens: int, seed: int = 0, vocab: int = 128,
             max_seq_len: int = MAX_SEQ_LEN) -> list[Item]:
    """`requests` prompts in random order: most are the system prompt plus a short user turn,
    the rest unrelated (at least one of each when requests >= 2)."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(SYSTEM_TOKENS)]
    n_shared = round(requests * SHARED_FRACTION)
    if requests >= 2:
        n_shared = min(max(n_shared, 1), requests - 1)
    limit = max_seq_len - 1  # longest prompt that can ever fit
    items = []
    for i in range(requests):
        if i < n_shared:
            user = [rng.randrange(vocab) for _ in range(rng.randint(4, 48))]
            prompt, shared = (system + user)[:limit], True
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(8, 120))][:limit]
            shared = False
        items.append(Item(prompt, max_new_tokens, shared))
    rng.shuffle(items)
    return items


# --------------------------------------------------------------------------- serving
def serve(batcher: AtomBatcher, items: Iterable[Item],
          on_done: Callable[[int], None] | None = None) -> tuple[dict[int, Result], float]:
    """Submit every item, step until all have ended; (results by request id, wall seconds)."""
    t0 = time.perf_counter()
    for it in items:
        batcher.submit(it.prompt, it.max_new_tokens)
    while batcher.busy():
        for ev in batcher.step():
            if ev.kind in ("finished", "error") and on_done is not None:
                on_done(ev.request_id)
    wall = time.perf_counter() - t0
    return {rid: Result(list(r.tokens), r.error) for rid, r in batcher.requests.items()}, wall


def demo_config(lanes: int, prefix_cache: bool = True, scratch: str = "dynamic",
                kv_blocks: int | None = None) -> Config:
    need = min_kv_blocks(lanes, prefix_cache, scratch)
    return Config(lanes=lanes, kv_blocks=need if kv_blocks is None else kv_blocks,
                  max_seq_len=MAX_SEQ_LEN, prefill_chunk=PREFILL_CHUNK,
                  prefix_cache=prefix_cache, scratch=scratch)


class _Progress:
    """A rich progress bar on stderr, or plain lines when rich is missing (or when quiet)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self._bar, self._task = enabled, None, None
        self._total, self._done, self._label, self._next = 0, 0, "", 0

    def __enter__(self) -> _Progress:
        if self.enabled:
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                )
            except ImportError:
                pass
            else:
                self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     console=Console(stderr=True), transient=False)
                self._bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def task(self, label: str, total: int) -> None:
        self._total, self._done, self._label, self._next = total, 0, label, 0
        if self._bar is not None:
            self._task = self._bar.add_task(label, total=total)
        elif self.enabled:
            print(f"{label}: 0/{total}", file=sys.stderr, flush=True)

    def advance(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.advance(self._task)
        elif self.enabled and (self._done * 10 // max(self._total, 1) > self._next
                               or self._done == self._total):
            self._next = self._done * 10 // max(self._total, 1)
            print(f"{self._label}: {self._done}/{self._total}", file=sys.stderr, flush=True)


def run_demo(lanes: int = 4, requests: int = 24, max_new_tokens: int = 16, seed: int = 0,
             prefix_cache: bool = True, scratch: str = "dynamic", kv_blocks: int | None = None,
             progress: bool = True, runtime: str = "reference",
             model: str | None = None, trace: IO[str] | None = None) -> dict[str, Any]:
    """Serve the workload, check it against the oracle; the summary as a JSON-able dict.

    runtime "reference": the tiny reference model and its oracle. runtime "hf": a transformers
    model (`model` a local checkpoint directory, or "tiny-llama" / "tiny-gemma3": seeded random
    weights saved and loaded back) in float64 on HFRuntime, checked against transformers' own greedy
    `generate` of the same weights. `trace`: the batcher's transitions as JSON lines
    (`demo --html` draws them)."""
    cfg = demo_config(lanes, prefix_cache, scratch, kv_blocks)
    # the registry's runtimes whose tokens can be checked (an oracle), loadable by name
    checkable = registry.names(lambda k: k.load is not None and k.oracle is not None)
    if runtime not in checkable:
        raise ValueError(f"unknown runtime {runtime!r}: {' or '.join(checkable)}")
    kind = registry.get(runtime)
    assert kind.load is not None and kind.oracle is not None
    request = RuntimeRequest(seed=MODEL_SEED)
    if runtime == "hf":
        from atom_core.runtime.hf import TINY_LLAMA, with_model_window

        name = model or TINY_LLAMA
        cfg = with_model_window(cfg, name)  # a Gemma3 model's batcher needs its window
        request = RuntimeRequest(model=name, seed=MODEL_SEED, dtype="float64")
    elif model is not None:
        raise ValueError("--model is for --runtime hf (the reference model is built in)")
    rt = kind.load(cfg, request)
    oracle = kind.oracle(rt)
    items = workload(requests, max_new_tokens, seed, rt.vocab_size, cfg.max_seq_len)
    batcher = AtomBatcher(cfg, rt, trace=trace)
    with _Progress(progress) as bar:
        bar.task("serving", len(items))
        results, wall = serve(batcher, items, lambda _rid: bar.advance())
        bar.task("checking against the oracle", len(items))
        mismatches = []
        for rid, it in enumerate(items):
            res = results[rid]
            if res.error is not None or res.tokens != oracle.generate(it.prompt,
                                                                      it.max_new_tokens):
                mismatches.append(rid)
            bar.advance()
    st = batcher.stats
    prompt_tokens = sum(len(it.prompt) for it in items)
    # the threads the runtime's calls ran on (both runtimes default to one), else torch's
    threads = getattr(rt, "num_threads", None) or torch.get_num_threads()
    return {
        "runtime": runtime if model is None else f"{runtime} ({model})",
        "config": {"lanes": cfg.lanes, "kv_blocks": cfg.kv_blocks,
                   "max_seq_len": cfg.max_seq_len, "prefill_chunk": cfg.prefill_chunk,
                   "prefix_cache": cfg.prefix_cache, "scratch": cfg.scratch,
                   "rule": cfg.rule, "seed": seed, "torch_threads": threads},
        "requests": len(items),
        "shared_prefix_requests": sum(it.shared for it in items),
        "completed": sum(1 for r in results.values() if r.error is None),
        "errors": sum(1 for r in results.values() if r.error is not None),
        "prompt_tokens": prompt_tokens,
        "prefix_hit_tokens": st.prefix_hit_tokens,
        "prefill_tokens": st.prefill_tokens,
        "prefill_tokens_saved": st.prefix_hit_tokens,
        "prefill_saved_pct": round(100.0 * st.prefix_hit_tokens / max(prompt_tokens, 1), 1),
        "decode_steps": st.decode_steps,
        "decode_rows_padding": st.decode_rows_padding,
        "generated_tokens": st.generated_tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(st.generated_tokens / wall, 1) if wall > 0 else None,
        "exact": not mismatches,
        "mismatches": mismatches,
    }


def print_summary(out: dict[str, Any]) -> None:
    c = out["config"]
    rows = [
        ("configuration", f"lanes={c['lanes']}, kv_blocks={c['kv_blocks']} ({c['rule']}), "
                          f"max_seq_len={c['max_seq_len']}, prefill_chunk={c['prefill_chunk']}"),
        ("requests", f"{out['requests']} ({out['shared_prefix_requests']} share a "
                     f"{SYSTEM_TOKENS}-token system prompt); {out['completed']} completed, "
                     f"{out['errors']} failed"),
        ("prompt tokens", str(out["prompt_tokens"])),
        ("prefix-hit tokens", str(out["prefix_hit_tokens"])),
        ("prefill tokens computed", str(out["prefill_tokens"])),
        ("prefill tokens saved", f"{out['prefill_tokens_saved']} "
                                 f"({out['prefill_saved_pct']}% of prompt tokens)"),
        ("decode steps", f"{out['decode_steps']} ({out['decode_rows_padding']} padding rows)"),
        ("generated tokens", str(out["generated_tokens"])),
        ("tokens/s", f"{out['tokens_per_s']}"),
        ("wall time", f"{out['wall_s']:.2f} s (serving; the oracle check is not timed)"),
        ("token-exact vs oracle", "YES: every request equals the oracle's tokens" if out["exact"]
         else f"NO: requests {out['mismatches']} differ from the oracle"),
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"atom-core demo ({out['runtime']} runtime)")
        for k, v in rows:
            print(f"  {k:<26}{v}")
        return
    t = Table(title=f"atom-core demo ({out['runtime']} runtime)", show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
