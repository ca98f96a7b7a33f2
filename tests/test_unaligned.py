"""An eager artifact whose max_seq_len is not a multiple of the prefill chunk (optimum-rbln allows
it and pads a prompt's last chunk): the spec's axiom `chunk_divides_block` binds paged tables
only, so such a Config is accepted, and a prompt whose padded last chunk reaches past
max_seq_len is served token-exactly without its padding rows touching any block."""

from __future__ import annotations

import random

import pytest
import torch

from atom_core._generated import core
from atom_core.batcher import AtomBatcher
from atom_core.config import Config, ConfigError
from atom_core.demo import oracle_for
from atom_core.runtime import TorchReferenceRuntime
from atom_core.runtime.protocol import RuntimeInputError

C, S = 64, 96  # the last chunk of a prompt longer than 64 is padded to 128 > 96


def test_the_axiom_binds_paged_tables_only() -> None:
    eager = Config(lanes=2, kv_blocks=4, prefill_chunk=C, max_seq_len=S).consts()
    assert eager.S % eager.C and core.check_axioms(eager) == []
    with pytest.raises(ConfigError, match="chunk_divides_block"):
        Config(lanes=2, kv_blocks=8, prefill_chunk=256, max_seq_len=768, block_size=384)


def _drive(b: AtomBatcher, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not b.busy():
            return
        b.step()
        b.check_invariants()
    raise AssertionError("not idle")


@pytest.mark.parametrize("window,prefix,scratch", [
    (w, p, s) for w in (None, 16) for p in (False, True) for s in ("reserved", "dynamic")
    if w is None or p or s == "dynamic"])  # (one hybrid case without the cache is enough)
def test_prompts_up_to_max_seq_len_are_exact(scratch: str, prefix: bool,
                                             window: int | None) -> None:
    lanes = 2
    extra = (1 if scratch == "reserved" else 0) + (1 if prefix else 0)
    cfg = Config(lanes=lanes, kv_blocks=lanes + extra + 1, prefill_chunk=C, max_seq_len=S,
                 prefix_cache=prefix, scratch=scratch, sliding_window=window)
    model = {} if window is None else {"sliding_window": window, "layers": 3, "global_every": 3}
    rt = TorchReferenceRuntime.tiny(cfg, **model)
    b = AtomBatcher(cfg, rt, ghost=True)
    rng = random.Random(7)
    shared = [rng.randrange(1, 128) for _ in range(C)]
    # lengths whose last chunk is padded past S (65..95), one ending exactly at S - 1 so that
    # its one generated token fills the sequence, and short ones beside them
    prompts = [shared + [rng.randrange(1, 128) for _ in range(n - C)] for n in (70, 95, 80, 90)]
    prompts += [[rng.randrange(1, 128) for _ in range(n)] for n in (5, 64, 93)]
    for p in prompts:
        b.submit(p, max_new_tokens=S - len(p))
    _drive(b)
    oracle = oracle_for(rt)
    for rid, r in b.requests.items():
        assert r.error is None, (rid, r.error)
        assert r.tokens == oracle.generate(r.prompt, r.max_new_tokens), rid
        assert len(r.prompt) + len(r.tokens) <= S
    if prefix:
        assert b.stats.prefix_hit_tokens >= C


def test_padding_rows_past_the_end_store_nothing() -> None:
    cfg = Config(lanes=1, kv_blocks=3, prefill_chunk=C, max_seq_len=S)
    rt = TorchReferenceRuntime.tiny(cfg)
    for cache in (*rt.k_cache, *rt.v_cache):
        cache.fill_(7.0)
    ids = torch.randint(1, 100, (1, C))
    pos = torch.arange(C, 2 * C, dtype=torch.int32)[None]
    # 20 real tokens at 64..83, padding rows at 84..127 (96.. past the block's end)
    rt.prefill(ids, pos, torch.tensor([1], dtype=torch.int16), None,
               torch.tensor(19, dtype=torch.int16))
    for cache in (*rt.k_cache, *rt.v_cache):
        assert torch.all(cache[0] == 7.0) and torch.all(cache[2] == 7.0)  # other blocks
        assert not torch.any(cache[1, :, C:C + 20] == 7.0)  # the real rows were stored
        assert torch.all(cache[1, :, :C] == 7.0)  # earlier positions untouched


def test_a_real_token_past_the_end_is_refused() -> None:
    cfg = Config(lanes=1, kv_blocks=3, prefill_chunk=C, max_seq_len=S)
    rt = TorchReferenceRuntime.tiny(cfg)
    pos = torch.arange(C, 2 * C, dtype=torch.int32)[None]
    with pytest.raises(RuntimeInputError, match="past max_seq_len=96"):
        rt.prefill(torch.ones((1, C), dtype=torch.int64), pos,
                   torch.tensor([1], dtype=torch.int16), None,
                   torch.tensor(S - C, dtype=torch.int16))


# --------------------------------------------------------------------------- the proofs


def _padded_chunk_must_fit():
    """A plausible wrong guard: the whole padded chunk must fit in the block (instead of its real
    tokens). Where the block is a multiple of the chunk the two agree on every reachable state;
    at an eager block that is not, a prompt whose last chunk is padded past the end is stuck."""
    from atom_core.spec.model import MODEL, C, S, length, start, tail
    m = MODEL.copy()
    a = m.get_action("prefill")
    (lane,) = [p for p in a.params if p.name == "l"]
    a.guards = [(g, (length(lane) + C <= start(tail(lane)) + S) if g == "chunk_within_block"
                 else e) for g, e in a.guards]
    return m


def _stuck(model, seq_len: int) -> set[str]:
    from atom_core.proofs import capacity
    f = capacity.Features(False, "dynamic")
    cs = capacity.progress_by_features(model, 1, 2, cutoff=1, seq_len=seq_len)[f]
    return {c.invariant for c in cs if c.status != "proved"}


def test_only_the_unaligned_checks_catch_a_chunk_that_must_fit_padded(fresh_z3) -> None:
    from atom_core.proofs import checks
    from atom_core.spec.model import MODEL
    bad = _padded_chunk_must_fit()
    assert _stuck(MODEL, checks.SEQ_LEN) == set() == _stuck(MODEL, checks.UNALIGNED_SEQ_LEN)
    assert _stuck(bad, checks.SEQ_LEN) == set()  # the aligned checks miss it
    assert _stuck(bad, checks.UNALIGNED_SEQ_LEN) != set()


def test_unaligned_rule_compares_the_minimum_within_its_cutoff() -> None:
    from atom_core.proofs import capacity, checks, run
    f = capacity.Features(True, "reserved")
    aligned = capacity.Row(f, 2, {1: 3, 2: 4, 3: 5, 4: 6}, [], {})
    inside = {b: k if k <= checks.UNALIGNED_BLOCKS else None
              for b, k in aligned.minimum.items() if b <= checks.UNALIGNED_LANES}
    same = capacity.Row(f, 2, inside, [], {})
    assert run.unaligned_rule(f, aligned, same).status == "proved"
    worse = capacity.Row(f, None, {**inside, 1: inside[1] + 1}, [], {})
    c = run.unaligned_rule(f, aligned, worse)
    assert c.status == "counterexample" and "S=4000" in c.detail
