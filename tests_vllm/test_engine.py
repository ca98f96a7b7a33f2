"""`AtomScheduler` inside vLLM's own engine: every request's tokens equal those of vLLM's own
scheduler on the same runner (and greedy ones transformers' `generate()`), the core's invariants
hold after every call, and nothing is held when the engine is idle."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from checked import CheckedAtomScheduler
from vllm import LLM, SamplingParams

from atom_core.config import ConfigError

ATOM = CheckedAtomScheduler
SEQS, MAX_LEN, BLOCK = 4, 256, 64
T = MAX_LEN // BLOCK  # blocks per table
# the proved minimum with preemption: one lane's whole table and a padding block (the core's
# K), plus vLLM's null block
MIN_BLOCKS = T + 1 + 1
# enough for every lane's whole table, few enough that checking the core's invariants after
# every call stays cheap (vLLM's profiled count here would be 16,384)
BLOCKS = SEQS * T + 8


def engine(model: Path, scheduler: Any, *, prefix: bool = False, blocks: int | None = None,
           block: int = BLOCK, max_len: int = MAX_LEN) -> LLM:
    return LLM(model=str(model), max_num_seqs=SEQS, max_model_len=max_len, block_size=block,
               enforce_eager=True, dtype="float32", seed=0, enable_prefix_caching=prefix,
               scheduler_cls=scheduler, num_gpu_blocks_override=blocks or BLOCKS)


@pytest.fixture(scope="module")
def engines(tiny_llama: Path) -> Iterator[dict[Any, LLM]]:
    """The engine for (scheduler, prefix cache, blocks), built when asked for. One at a time:
    vLLM keeps its parallel state per process, and building an engine leaves the ones built
    before it unusable ("pipeline model parallel group is not initialized")."""

    class Engines(dict):  # type: ignore[type-arg]
        def __missing__(self, key: Any) -> LLM:
            self.clear()
            gc.collect()
            scheduler, prefix, blocks = key
            self[key] = engine(tiny_llama, scheduler, prefix=prefix, blocks=blocks)
            return self[key]

    built = Engines()
    yield built
    built.clear()
    gc.collect()


def prompts() -> list[list[int]]:
    """More requests than lanes, prompt lengths from 3 to about 150 tokens (several chunks and
    blocks), half of them sharing a 130-token prefix (two whole blocks and a part)."""
    shared = [(7 * i) % 400 + 3 for i in range(130)]
    out = []
    for i in range(12):
        own = [(11 * i + 5 * j) % 500 + 3 for j in range(3 + 13 * i % 29)]
        out.append(shared + own if i % 2 else own)
    return out


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(llm: LLM, ps: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs]
            for o in outs]


def last_atom() -> CheckedAtomScheduler:
    return CheckedAtomScheduler.instances[-1]


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_greedy_tokens_equal_vllms_scheduler(engines: dict, prefix: bool) -> None:
    ps = prompts()
    params = [greedy(1 + (5 * i) % 40) for i in range(len(ps))]
    theirs = run(engines[None, prefix, None], ps, params)
    ours = run(engines[ATOM, prefix, None], ps, params)
    assert ours == theirs
    sched = last_atom()
    assert sched.idle() == [] and sched.steps > 0
    # steps that computed several requests' prompt chunks beside other requests' decodes
    assert any(chunks >= 2 and decodes >= 1 for chunks, decodes in sched.shapes)
    if prefix:  # the shared prefix was reused, not recomputed
        assert sched.core.stats.prefix_hit_tokens >= 128


def test_greedy_tokens_equal_transformers_generate(engines: dict, tiny_llama: Path) -> None:
    import torch
    import transformers as hf

    model = hf.LlamaForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    ps = prompts()[:6]
    ours = run(engines[ATOM, True, None], ps, greedy(24))
    for p, got in zip(ps, ours, strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert list(got[0][0]) == want


def test_preemption_at_the_proved_minimum_is_exact(engines: dict) -> None:
    """K = T + 1 (and vLLM's null block): lanes grow into each other and are preempted, and
    every request still gets the tokens it gets with vLLM's own scheduler."""
    ps = [p for p in prompts() if len(p) > 100][:6]
    theirs = run(engines[None, False, MIN_BLOCKS], ps, greedy(90))
    ours = run(engines[ATOM, False, MIN_BLOCKS], ps, greedy(90))
    assert ours == theirs
    sched = last_atom()
    assert sched.config.kv_blocks == T + 1
    assert sched.core.stats.preemptions > 0 and sched.idle() == []


def test_below_the_proved_minimum_vllm_is_refused_naming_the_rule(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match=r"rule '.*' needs 5.*--num-gpu-blocks-override 6"):
        engine(tiny_llama, ATOM, blocks=MIN_BLOCKS - 1)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"block": 32}, "--block-size 32 is not a multiple of 64"),
    ({"max_len": 200}, "--max-model-len 200 is not a multiple of --block-size 64"),
])
def test_settings_outside_the_model_are_refused_in_vllms_words(
        tiny_llama: Path, kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        engine(tiny_llama, ATOM, **kwargs)


def test_stop_strings_stop_ids_and_eos_end_requests_as_vllm_does(engines: dict) -> None:
    ps = prompts()
    free = run(engines[None, True, None], ps, greedy(30))
    # stop on tokens that do occur: a stop string, a stop id, the end token (as eos)
    text_stop = free[0][0][3].split()[5]
    id_stop = free[1][0][0][7]
    params = [SamplingParams(temperature=0, max_tokens=30, stop=[text_stop]),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[id_stop]),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=3,
                             stop_token_ids=[free[2][0][0][1], free[2][0][0][4]]),
              SamplingParams(temperature=0, max_tokens=30, stop=[" ", "t"],
                             include_stop_str_in_output=True)] * 3
    theirs = run(engines[None, True, None], ps, params)
    ours = run(engines[ATOM, True, None], ps, params)
    assert ours == theirs
    stops = [o[0][2] for o in ours if o[0][1] == "stop"]
    assert len(stops) >= 6 and len(set(stops)) > 2  # strings and ids, not just eos
    sched = last_atom()
    assert sched.idle() == []
    # a stop is a finish, not an abort: the requests' blocks went to the prefix cache
    assert "cache" in sched.core.describe()["blocks"]


def test_sampling_n_seeds_and_logprobs_equal_vllms(engines: dict) -> None:
    # Prompts of one chunk: vLLM's CPU runner cannot rewind a seeded request's generator after
    # a prompt chunk that samples nothing ("CPU Generator does not use offset"), so seeded
    # sampling over a prompt prefilled in several steps fails in vLLM itself, whichever
    # scheduler splits it (its own does too, past max_num_batched_tokens).
    ps = [p for p in prompts() if len(p) < BLOCK][:5]
    params = [SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=11 + i, max_tokens=12,
                             logprobs=2) for i in range(len(ps))]
    outs = {}
    for name in (None, ATOM):
        gen = engines[name, True, None].generate([{"prompt_token_ids": p} for p in ps], params,
                                                 use_tqdm=False)
        outs[name] = [[(c.token_ids, [{t: round(lp.logprob, 4) for t, lp in step.items()}
                                      for step in c.logprobs]) for c in o.outputs]
                      for o in gen]
    assert outs[ATOM] == outs[None]
    assert all(len(o) == 3 for o in outs[ATOM])
    assert last_atom().idle() == []


def test_prompt_logprobs_with_the_prefix_cache_cover_every_prompt_token(engines: dict) -> None:
    """A request asking for its prompt's logprobs takes no prefix hit (vLLM's
    `skip_reading_prefix_cache`): its runner computes logprobs only for the positions it is
    given, so a hit would leave the shared prefix's out. Its prompt logprobs equal vLLM's own
    scheduler's, one per prompt token, while the requests beside it still take their hits."""
    ps = prompts()[:8]
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                             prompt_logprobs=1 if i in (3, 5) else None)
              for i in range(len(ps))]
    outs = {}
    for name in (None, ATOM):
        # (no reference to an engine kept: the next one is built after the fixture drops it)
        engines[name, True, None].generate([{"prompt_token_ids": p} for p in ps[:2]],
                                           greedy(2), use_tqdm=False)
        gen = engines[name, True, None].generate([{"prompt_token_ids": p} for p in ps], params,
                                                 use_tqdm=False)
        outs[name] = [(o.outputs[0].token_ids, None if o.prompt_logprobs is None else
                       [None if d is None else {t: round(lp.logprob, 4) for t, lp in d.items()}
                        for d in o.prompt_logprobs]) for o in gen]
    assert outs[ATOM] == outs[None]
    for i in (3, 5):  # (prompts 1, 3, 5, 7 share a 130-token prefix, cached by prompt 1)
        lps = outs[ATOM][i][1]
        assert lps is not None and len(lps) == len(ps[i]) and lps[0] is None
        assert all(d is not None and ps[i][j] in d for j, d in enumerate(lps) if j)
    sched = last_atom()
    assert sched.core.stats.prefix_hit_tokens >= 128  # the others took their hits
    assert sched.idle() == []


def test_aborts_mid_stream_free_everything_and_spare_the_rest(engines: dict) -> None:
    llm = engines[ATOM, True, None]
    eng = llm.llm_engine
    ps = prompts()[:8]
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, greedy(40))
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 12:  # some decoding, some waiting, some mid-prompt
            eng.abort_request(["r1", "r4", "r6"])
    assert set(done) == {"r0", "r2", "r3", "r5", "r7"}
    want = run(engines[None, True, None], [ps[int(r[1:])] for r in sorted(done)], greedy(40))
    assert [done[r] for r in sorted(done)] == [list(w[0][0]) for w in want]
    assert last_atom().idle() == []
