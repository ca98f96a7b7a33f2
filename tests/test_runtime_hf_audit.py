"""Audit of HFRuntime against transformers' own greedy `generate()` at the edges where paged,
chunked, prefix-cached and sliding-window serving has gone wrong in other engines.

Each test runs AtomBatcher over HFRuntime with a tiny random-weight model (built offline from a
transformers config, saved and loaded back) and compares every request's tokens with
`generate(do_sample=False)` of the same weights, one request at a time, through
`tests.test_runtime_hf.Oracle` (float64, and every compared step's top-1/top-2 logit gap above
MARGIN, so rounding cannot flip a token).

- Prompt lengths at every chunk / block boundary (1, C-1, C, C+1, B-1, B, B+1, several blocks,
  max_seq_len-1) with generation crossing block and chunk boundaries and running to
  max_seq_len, several lanes of different lengths decoding together (padding rows included).
- Gemma3 sliding windows below, at, above the chunk and above the block, not multiples of the
  chunk: prompts and generations of W-1, W, W+1, 2W tokens.
- Prefix hits (the sliding state restored from a snapshot): a hit of exactly one chunk, of all
  but the last token, ending inside a block, reaching past the first block.
- Preemption with recomputation beside prefix hits, hybrid.
- RoPE whose frequencies transformers picks per forward call (dynamic NTK, LongRoPE): the
  padding of an eager table's last chunk past max_seq_len must not change them. LongRoPE is
  refused when its original length is below max_seq_len (chunked prefill and batched decode
  change the tokens, shown with the refusal bypassed), exact when it is not.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from atom_core.batcher import AtomBatcher  # noqa: E402
from atom_core.config import Config, min_kv_blocks  # noqa: E402
from atom_core.runtime import hf  # noqa: E402
from atom_core.runtime.hf import HFRuntime, UnsupportedModelError  # noqa: E402
from atom_core.runtime.reference import torch_threads  # noqa: E402
from tests.test_runtime_hf import F64, Oracle  # noqa: E402

S, C = 256, 64  # max_seq_len and prefill chunk of every config here
BLOCK = 128     # block size: two chunks a block, so a chunk boundary can fall inside a block
V = 128

# longrope: 16 factors for head_dim 32; the original length 64 makes every prompt past one
# chunk "long" for transformers
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(V) for _ in range(n)]


def config(lanes: int, *, window: int | None = None, prefix: bool = False,
           preemption: bool = False, extra: int = 1, block: int = BLOCK,
           seq_len: int = S) -> Config:
    t = seq_len // block
    return Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, "dynamic", t,
                                                       preemption=preemption) + extra,
                  max_seq_len=seq_len, block_size=block, prefill_chunk=C, prefix_cache=prefix,
                  sliding_window=window, preemption=preemption)


_DIRS: dict[tuple[Any, ...], Path] = {}
_ORACLES: dict[Path, Oracle] = {}


def checkpoint(tmp_root: Path, kind: str, window: int | None = None, seq_len: int = S,
               **fields: Any) -> Path:
    """A tiny float64 checkpoint directory (saved with save_pretrained), one per model;
    max_position_embeddings is seq_len."""
    key = (kind, window, seq_len, repr(sorted(fields.items())))
    if key not in _DIRS:
        if kind == "llama":
            model = HFRuntime.tiny_llama_model(0, max_position=seq_len, dtype=F64, **fields)
        else:
            assert window is not None
            model = HFRuntime.tiny_gemma3_model(0, sliding_window=window, max_position=seq_len,
                                                dtype=F64, **fields)
        d = tmp_root / f"{kind}-{len(_DIRS)}"
        model.save_pretrained(d)
        _DIRS[key] = d
    return _DIRS[key]


def oracle(d: Path) -> Oracle:
    """transformers' generate on the checkpoint loaded with its default attention."""
    if d not in _ORACLES:
        from transformers import AutoModelForCausalLM

        _ORACLES[d] = Oracle(AutoModelForCausalLM.from_pretrained(
            d, local_files_only=True, dtype=F64))
    return _ORACLES[d]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("audit-models")


def serve(cfg: Config, d: Path, work: list[tuple[list[int], int]]) -> AtomBatcher:
    """Run `work` through a batcher over the checkpoint and assert every request equals
    generate() (the batcher stops a request when its KV would pass max_seq_len: at most
    max_seq_len - len(prompt) + 1 tokens)."""
    b = AtomBatcher(cfg, HFRuntime.from_pretrained(d, cfg, dtype=F64, num_threads=1))
    rids = [b.submit(p, n) for p, n in work]
    for _ in range(20_000):
        if not b.busy():
            break
        b.step()
    assert not b.busy()
    orc = oracle(d)
    for r, (p, n) in zip(rids, work, strict=True):
        req = b.requests[r]
        assert req.error is None, req.error
        with torch_threads(1):  # a tiny model runs faster on one thread (bench.hf)
            want = orc.generate(p, min(n, cfg.max_seq_len - len(p) + 1))
        assert req.tokens == want, f"prompt of {len(p)} tokens, {n} new"
    return b


# --------------------------------------------------------------------------- boundaries
BOUNDARY_LENGTHS = (1, C - 1, C, C + 1, BLOCK - 1, BLOCK, BLOCK + 1, 200, S - 1)


def test_prompt_lengths_at_every_boundary_llama(root: Path) -> None:
    """Prompts at each chunk and block boundary, three lanes of different lengths decoding
    together (so finished lanes leave padding rows and waiting ones are admitted mid-decode);
    generations cross chunk and block boundaries and one runs until max_seq_len."""
    work = [(prompt(n, n), 300 if n == C + 1 else 24) for n in BOUNDARY_LENGTHS]
    b = serve(config(3), checkpoint(root, "llama"), work)
    assert b.stats.decode_rows_padding > 0 and b.stats.table_grows > 0


@pytest.mark.parametrize("window", [C - 1, C + 1, 100, BLOCK + 1],
                         ids=["W=C-1", "W=C+1", "W=100", "W=B+1"])
def test_sliding_window_boundaries_gemma3(root: Path, window: int) -> None:
    """Gemma3 (sliding, global, sliding layers): prompts of W-1, W, W+1 and 2W tokens and
    generations crossing W during decode; W never a multiple of the chunk, so the window's edge
    falls inside a prefill chunk; W above and below the block size."""
    lengths = sorted({n for n in (1, window - 1, window, window + 1, 2 * window, C + 1)
                      if 1 <= n < S})
    # prompts below the window generate past it (W crossed during decode), the others a few
    work = [(prompt(n, n + window), max(12, window + 3 - n)) for n in lengths]
    serve(config(3, window=window), checkpoint(root, "gemma3", window), work)


# --------------------------------------------------------------------------- prefix hits
@pytest.mark.parametrize("kind,window", [("llama", None), ("gemma3", 40), ("gemma3", 100)],
                         ids=["llama", "gemma3-W40", "gemma3-W100"])
def test_prefix_hits_at_every_boundary(root: Path, kind: str, window: int | None) -> None:
    """One lane, so each request runs after the previous one is cached: a second request
    sharing exactly one chunk, all but the last token (the hit ends one token short of a
    chunk boundary, or just before the prompt's end), a hit ending inside a block and one past
    the first block. Hybrid hits restore the sliding layers from a snapshot."""
    base = prompt(240, 7)
    shares = [(C, 1), (C, 9), (BLOCK, 1), (BLOCK + C, 0), (BLOCK + C, 5), (2 * BLOCK - 1, 0)]
    work = [(base[:200], 4)] + [(base[:n] + prompt(k, 100 + n + k), 20) for n, k in shares]
    b = serve(config(1, window=window, prefix=True), checkpoint(root, kind, window), work)
    assert b.stats.prefix_hit_tokens >= len(shares) * C
    if window is not None:
        assert b.stats.snapshots > 0 and b.runtime.calls["update_local"] >= len(shares)


def test_preemption_beside_prefix_hits_gemma3(root: Path) -> None:
    """Preempted lanes recompute their prompt and tokens so far (rebuilding the window) while
    other requests hit the cached system prompt: still the tokens generate() gives."""
    window = 40
    system = prompt(150, 77)
    work = [(system + prompt(k, 300 + k), n) for k, n in [(3, 90), (10, 80), (1, 100)]]
    work.append((prompt(100, 5), 100))
    cfg = config(2, window=window, prefix=True, preemption=True, extra=0, block=C)
    b = serve(cfg, checkpoint(root, "gemma3", window), work)
    assert b.stats.preemptions > 0 and b.stats.prefix_hit_tokens > 0


# --------------------------------------------------------------------------- rope
def test_longrope_past_its_original_length_is_refused(root: Path) -> None:
    """transformers picks LongRoPE's factors per forward call (long when the call's largest
    position passes the original length), so a chunked prefill and a batched decode rotate
    keys differently from generate(): refused, naming the fix."""
    d = checkpoint(root, "llama", rope_scaling={**LONGROPE,
                                                "original_max_position_embeddings": C})
    with pytest.raises(UnsupportedModelError, match="LongRoPE.*original_max_position_"
                                                    "embeddings=64 < max_seq_len=256"):
        HFRuntime.from_pretrained(d, config(2), dtype=F64)
    model = hf.AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=F64,
                                                    attn_implementation=hf.ATTENTION)
    with pytest.raises(UnsupportedModelError, match="LongRoPE"):
        HFRuntime.for_config(model, config(2))


def test_longrope_refusal_is_needed(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why: with the refusal bypassed, a 65-token prompt (two chunks: the first one's keys
    rotated by the short factors, generate() rotates all by the long ones) continues
    differently from generate()."""
    from atom_core.runtime import hf_checks  # (check_model_config's module)

    monkeypatch.setattr(hf_checks, "_check_rope", lambda config, max_seq_len: None)
    d = checkpoint(root, "llama", rope_scaling={**LONGROPE,
                                                "original_max_position_embeddings": C})
    cfg = config(1)
    b = AtomBatcher(cfg, HFRuntime.from_pretrained(d, cfg, dtype=F64, num_threads=1))
    p = prompt(C + 1, 3)
    rid = b.submit(p, 4)
    while b.busy():
        b.step()
    with torch_threads(1):
        assert b.requests[rid].tokens != oracle(d).generate(p, 4)


def test_longrope_within_its_original_length_is_exact(root: Path) -> None:
    """With max_seq_len <= the original length every call takes the short factors: served,
    and exact across chunks, blocks and lanes of different lengths."""
    d = checkpoint(root, "llama", rope_scaling={**LONGROPE, "short_factor": [1.5] * 16,
                                                "original_max_position_embeddings": S})
    work = [(prompt(n, 40 + n), 20) for n in (1, C + 1, BLOCK + 1, 200)]
    serve(config(2), d, work)


EAGER = 200  # an eager table (one block of max_seq_len) whose last chunk is padded past its end


@pytest.mark.parametrize("kind,window,rope", [
    ("llama", None, {**LONGROPE, "original_max_position_embeddings": EAGER}),
    ("gemma3", 50, {"rope_type": "dynamic", "factor": 2.0}),
], ids=["llama-longrope", "gemma3-dynamic"])
def test_padded_last_chunk_does_not_change_the_rope(root: Path, kind: str, window: int | None,
                                                    rope: dict[str, Any]) -> None:
    """max_seq_len 200 with chunks of 64: the last chunk (positions 192..255) is padded past
    the sequence's end. transformers' dynamic RoPEs pick the whole call's frequencies from its
    largest position id, so those padding positions, if the model saw them, would rotate the
    chunk's real tokens (and, NTK keeping its state, later decode steps) unlike generate().
    Prompts ending inside that chunk, generated to max_seq_len."""
    d = checkpoint(root, kind, window, seq_len=EAGER, rope_scaling=rope)
    work = [(prompt(n, 60 + n), 12) for n in (150, 192, 193, EAGER - 1)]
    serve(config(2, window=window, block=EAGER, seq_len=EAGER), d, work)
