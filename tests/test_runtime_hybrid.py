"""Hybrid (Gemma3-style) reference runtime: sliding-window layers with their KV in per-lane local
window slots (as the RBLN kernel keeps them) beside global layers with their KV in the blocks.
The cached path (chunked prefill, decode, local slots moved through host buffers) must agree bit
for bit with the cache-free oracle, whatever the chunk size relative to the window."""

from __future__ import annotations

import pytest
import torch

from atom_core.config import Config
from atom_core.runtime import Runtime, RuntimeInputError, RuntimeSpec, TorchReferenceRuntime
from atom_core.runtime.paged import window_positions
from atom_core.runtime.reference import _visible

C = 64
S = 256
SCRATCH = 7


def make(window: int | None, seed: int = 0, **kw) -> TorchReferenceRuntime:
    """Layers: sliding, global, sliding (global_every=2) unless overridden."""
    base = dict(num_blocks=8, block_size=S, max_seq_len=S, prefill_chunk=C, batch_size=4,
                layers=3, global_every=2, sliding_window=window)
    base.update(kw)
    return TorchReferenceRuntime(RuntimeSpec(**base), seed=seed)


def prompt(n: int, seed: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def i16(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int16)


def prefill(rt: TorchReferenceRuntime, tokens: list[int], table: list[int], slot: int | None,
            start: int = 0, end: int | None = None, pad: int = 0) -> torch.Tensor:
    """Prefill tokens[start:end] chunk by chunk (chunk size rt.prefill_chunk) through `table`
    and local slot `slot` (None: a plain model); padding positions get token `pad`; the last
    chunk's logits [V]."""
    c, end = rt.prefill_chunk, len(tokens) if end is None else end
    lbt = None if slot is None else i16([slot])
    logits = None
    for s in range(start, end, c):
        chunk = tokens[s:min(s + c, end)]
        ids = torch.tensor([chunk + [pad] * (c - len(chunk))])
        pos = torch.arange(s, s + c, dtype=torch.int32)[None]
        logits = rt.prefill(ids, pos, i16(table), lbt, i16(len(chunk) - 1))
    assert logits is not None and logits.shape == (1, 1, rt.vocab_size)
    return logits[0, 0]


def decode(rt: TorchReferenceRuntime, rows: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """One decode call; each row is (token, position, block, local slot). Logits [B, V]."""
    ids = torch.tensor([[r[0]] for r in rows])
    pos = torch.tensor([[r[1]] for r in rows], dtype=torch.int32)
    out = rt.decode(ids, pos, i16([[r[2]] for r in rows]), i16([[r[3]] for r in rows]))
    assert out.shape == (len(rows), 1, rt.vocab_size)
    return out[:, 0]


def idle(rt: TorchReferenceRuntime, slot: int, k: int) -> tuple[int, int, int, int]:
    """A padding row aimed at the scratch block and at local slot `slot` (no live sequence)."""
    return (k * 5 % rt.vocab_size, (3 * k + 1) % rt.max_seq_len, SCRATCH, slot)


def continue_decoding(rt: TorchReferenceRuntime, seq: list[int], until: int, block: int,
                      slot: int, others: list[int]) -> list[int]:
    """Decode the sequence in row 0 (block, slot) until it has `until` tokens; the other rows
    are padding rows on the idle slots `others`. Returns the sequence."""
    while len(seq) < until:
        rows = [(seq[-1], len(seq) - 1, block, slot)]
        rows += [idle(rt, o, len(seq) + k) for k, o in enumerate(others)]
        seq.append(int(torch.argmax(decode(rt, rows)[0])))
    return seq


# --- the model ---------------------------------------------------------------------------------

def test_masks_select_the_window_by_position() -> None:
    v = _visible(torch.tensor([5, 1]), torch.arange(8), 3)
    assert torch.nonzero(v[0])[:, 0].tolist() == [3, 4, 5]
    assert torch.nonzero(v[1])[:, 0].tolist() == [0, 1]
    assert torch.equal(_visible(torch.tensor([5]), torch.arange(8), None)[0],
                       torch.arange(8) <= 5)
    # a window of 4 read at position 9 holds 5..8 in order; at 2: 0, 1; at 0: nothing
    assert window_positions(torch.tensor([9, 2, 0]), 4).tolist() == \
        [[5, 6, 7, 8], [0, 1, -1, -1], [-1, -1, -1, -1]]


def test_spec_layers_and_fingerprint() -> None:
    plain = make(None)
    assert not plain.uses_local_block_tables and plain.spec.sliding_layers == ()
    assert plain.spec.global_layers == (0, 1, 2) and plain.k_local == []
    # the pattern is meaningless without a window: it does not change a plain fingerprint
    assert make(None, global_every=3).fingerprint == plain.fingerprint
    h = make(16)
    assert h.uses_local_block_tables and h.sliding_window == 16
    assert (h.spec.sliding_layers, h.spec.global_layers) == ((0, 2), (1,))
    assert make(16, layers=6, global_every=6).spec.global_layers == (5,)   # Gemma3's 5:1
    assert len(h.k_cache) == 1 and len(h.k_local) == 2
    assert h.k_local[0].shape == (4, 2, 16, 16)
    assert h.new_host_buffer().shape == (1, 2, 2, S, 16)
    assert h.new_local_host_buffer().shape == (2, 2, 2, 16, 16)
    fps = {plain.fingerprint, h.fingerprint, make(17).fingerprint,
           make(16, global_every=3).fingerprint, make(16, seed=1).fingerprint}
    assert len(fps) == 5
    # artifact sizes (blocks, lanes) stay out of it, as for plain models
    assert make(16, num_blocks=5, batch_size=2).fingerprint == h.fingerprint
    assert isinstance(h, Runtime)


def test_a_window_covering_everything_is_the_plain_model() -> None:
    """Same seed, same weights: with W >= max_seq_len every window is the whole prefix, so the
    hybrid model's logits (oracle and cached) equal the plain model's bit for bit."""
    plain, wide = make(None, seed=3), make(S, seed=3)
    p = prompt(150, 1)
    assert torch.equal(plain.oracle_logits(p), wide.oracle_logits(p))
    assert torch.equal(prefill(plain, p, [1], None), prefill(wide, p, [1], 2))
    seq = p + [int(torch.argmax(plain.oracle_logits(p)))]
    rows = [(seq[-1], 150, 1, 2), idle(wide, 0, 1), idle(wide, 1, 2), idle(wide, 3, 3)]
    lp = plain.decode(torch.tensor([[r[0]] for r in rows]),
                      torch.tensor([[r[1]] for r in rows], dtype=torch.int32),
                      i16([[r[2]] for r in rows]), None)
    assert torch.equal(lp[:1, 0], decode(wide, rows)[:1])
    assert plain.generate(p, 8) == wide.generate(p, 8)
    # and a narrow window is a different model (the window is really applied)
    assert not torch.equal(make(16, seed=3).oracle_logits(p), plain.oracle_logits(p))


# --- cached path == oracle ---------------------------------------------------------------------

@pytest.mark.parametrize("window", [16, 64, 100])          # W < C, W == C, W > C
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_chunked_prefill_then_decode_matches_generate(window: int, n: int) -> None:
    rt = make(window)
    p = prompt(n, n)
    expect = rt.generate(p, 20)
    logits = prefill(rt, p, [5], slot=2)
    assert torch.equal(logits, rt.oracle_logits(p))
    seq = continue_decoding(rt, p + [int(torch.argmax(logits))], n + 20, block=5, slot=2,
                            others=[0, 1, 3])
    assert seq[n:] == expect


def test_window_content_does_not_depend_on_chunking_or_padding() -> None:
    """After a prompt, the window holds exactly its last min(n, W) positions at indices 0.. (and
    nothing else was written), whatever the chunk size (C < W, C == W, C > W) and whatever the
    padding tokens: padding positions never reach the window (they do reach the global blocks,
    as on the device)."""
    w = 16
    for n in (5, 65, 200):
        p = prompt(n, 40 + n)
        rings, globals_ = [], []
        for chunk, pad in ((64, 0), (64, 99), (16, 0), (8, 0), (256, 0), (256, 7)):
            rt = make(w, prefill_chunk=chunk)
            prefill(rt, p, [3], slot=1, pad=pad)
            rings.append(rt.read_local(1))
            globals_.append(rt.read_block(3)[..., :n, :])
            assert all(torch.equal(rt.read_local(s), torch.zeros_like(rings[-1]))
                       for s in (0, 2, 3))
        assert all(torch.equal(r, rings[0]) for r in rings), n
        assert all(torch.equal(g, globals_[0]) for g in globals_), n
        written = (rings[0] != 0).any(dim=4).any(dim=2).any(dim=1).any(dim=0)   # per index
        assert torch.nonzero(written)[:, 0].tolist() == list(range(min(n, w)))


def test_padding_tokens_of_the_last_chunk_change_nothing_later() -> None:
    w = 16
    p = prompt(70, 3)                # last chunk: 6 real positions, 58 padding (more than W)
    a, b = make(w), make(w)
    la, lb = prefill(a, p, [2], 0, pad=0), prefill(b, p, [2], 0, pad=77)
    assert torch.equal(la, lb) and torch.equal(a.read_local(0), b.read_local(0))
    sa = continue_decoding(a, p + [int(torch.argmax(la))], 90, 2, 0, [1, 2, 3])
    sb = continue_decoding(b, p + [int(torch.argmax(lb))], 90, 2, 0, [1, 2, 3])
    assert sa == sb and sa[70:] == a.generate(p, 20)


def test_sequences_in_different_slots_decode_together_and_slots_are_reused() -> None:
    """Rows and slots are independent (row r may use any slot); two live sequences in one decode
    batch, a smaller decode graph, and a slot reused by a shorter request over a longer one's
    stale window all stay exact."""
    w = 16
    rt = make(w, decoder_batch_sizes=(4, 2, 1))
    a, b = prompt(100, 51), prompt(30, 52)
    ea, eb = rt.generate(a, 30), rt.generate(b, 20)
    sa = a + [int(torch.argmax(prefill(rt, a, [4], slot=3)))]
    for _ in range(5):                # a alone, on the 1-row graph, in slot 3
        logits = decode(rt, [(sa[-1], len(sa) - 1, 4, 3)])
        assert torch.equal(logits[0], rt.oracle_logits(sa))
        sa.append(int(torch.argmax(logits[0])))
    sb = b + [int(torch.argmax(prefill(rt, b, [6], slot=0)))]
    while len(sa) < len(a) + 30:      # both, interleaved in one 2-row call
        rows = [(sa[-1], len(sa) - 1, 4, 3)]
        rows.append((sb[-1], len(sb) - 1, 6, 0) if len(sb) < len(b) + 20 else idle(rt, 1, 1))
        logits = decode(rt, rows)
        assert torch.equal(logits[0], rt.oracle_logits(sa))
        sa.append(int(torch.argmax(logits[0])))
        if len(sb) < len(b) + 20:
            assert torch.equal(logits[1], rt.oracle_logits(sb))
            sb.append(int(torch.argmax(logits[1])))
    assert sa[len(a):] == ea and sb[len(b):] == eb
    # slot 3 now holds a's window of positions 114..129; a shorter request reuses it as is
    c = prompt(9, 53)
    sc = c + [int(torch.argmax(prefill(rt, c, [4], slot=3)))]
    assert continue_decoding(rt, sc, 9 + 25, 4, 3, [0, 1, 2])[9:] == rt.generate(c, 25)


def test_junk_in_local_slots_never_matters() -> None:
    """Slots full of junk (NaN, inf, huge) before a sequence starts change nothing: every window
    entry a query sees was written by its own sequence, the rest is masked by position."""
    w = 100
    rt = make(w)
    g = torch.Generator().manual_seed(9)
    for slot in range(rt.batch_size):
        junk = torch.randn(rt.new_local_host_buffer().shape, generator=g) * 1e6
        junk[..., ::7, :] = float("nan")
        junk[..., 3::11, :] = float("inf")
        rt.update_local_cache(junk, slot)
    p = prompt(40, 4)                 # shorter than the window: most of the slot stays junk
    logits = prefill(rt, p, [1], slot=3)
    assert torch.equal(logits, rt.oracle_logits(p))
    seq = continue_decoding(rt, p + [int(torch.argmax(logits))], 40 + 15, 1, 3, [0, 1, 2])
    assert seq[40:] == rt.generate(p, 15)


# --- padding rows ------------------------------------------------------------------------------

def _live(rt: TorchReferenceRuntime, n: int, slot: int) -> list[int]:
    p = prompt(n, 60 + n)
    return p + [int(torch.argmax(prefill(rt, p, [2], slot)))]


def test_a_padding_row_in_another_slot_writes_only_there() -> None:
    w = 16
    rt = make(w)
    seq = _live(rt, 70, slot=1)
    before = [rt.read_local(s) for s in range(4)]
    logits = decode(rt, [(seq[-1], 70, 2, 1), (5, 9, SCRATCH, 0), (6, 33, SCRATCH, 2),
                         (7, 40, SCRATCH, 3)])
    assert torch.equal(logits[0], rt.oracle_logits(seq))
    after = [rt.read_local(s) for s in range(4)]

    def changed(s: int) -> list[int]:
        d = (before[s] != after[s]).any(dim=4).any(dim=2).any(dim=1).any(dim=0)
        return torch.nonzero(d)[:, 0].tolist()

    # the live window was full: it shifts by one (positions 55..70 now)
    assert changed(1) == list(range(w))
    # empty slots: position 9 lands at index 9; at 33 and 40 (past W) the zeros shift and the
    # row's own KV lands last
    assert (changed(0), changed(2), changed(3)) == ([9], [w - 1], [w - 1])


def test_a_padding_row_in_a_live_slot_corrupts_it() -> None:
    """Why the scheduler never aims a padding row at a busy lane's slot: a lane between two
    prefill chunks (64 positions in, window 16) padded in its own slot at its next position
    (what a ring allowed: that entry held a dead position) shifts its window, and the next
    chunk reads the wrong positions. In an idle lane's slot the same row is harmless."""
    w = 16
    p = prompt(150, 70)
    for pad_slot, exact in ((1, False), (0, True)):
        rt = make(w)
        prefill(rt, p, [2], 1, end=C)                 # chunk 0 only: next position 64
        decode(rt, [(9, 64, SCRATCH, pad_slot), idle(rt, 0, 1), idle(rt, 2, 2),
                    idle(rt, 3, 3)])
        logits = prefill(rt, p, [2], 1, start=C)
        assert torch.equal(logits, rt.oracle_logits(p)) == exact, pad_slot


# --- moving a sequence: global block + local slot ----------------------------------------------

def test_fetch_and_update_local_move_a_sequence_to_another_runtime() -> None:
    """A PD import of a hybrid model: prefill in A, move the global block and the local slot
    through host buffers into B (same model, other artifact sizes, junk everywhere), decode in
    B: token-exact against the oracle."""
    w = 16
    a = make(w)
    b = make(w, num_blocks=6, batch_size=2, decoder_batch_sizes=(2, 1))
    assert a.fingerprint == b.fingerprint
    p = prompt(90, 80)
    expect = a.generate(p, 20)
    first = int(torch.argmax(prefill(a, p, [3], slot=2)))
    blk, loc = a.new_host_buffer(), a.new_local_host_buffer()
    a.fetch_kv_cache(blk, 3)
    a.fetch_local_cache(loc, 2)
    assert torch.equal(loc, a.read_local(2)) and torch.equal(blk, a.read_block(3))
    g = torch.Generator().manual_seed(11)
    for i in range(b.num_blocks):
        b.update_kv_cache(torch.randn(b.new_host_buffer().shape, generator=g) * 50, i)
    for s in range(b.batch_size):
        b.update_local_cache(torch.randn(b.new_local_host_buffer().shape, generator=g) * 50, s)
    b.update_kv_cache(blk, 4)
    b.update_local_cache(loc, 1)
    assert torch.equal(b.read_local(1), loc)
    seq = p + [first]
    while len(seq) < 110:
        logits = decode(b, [(seq[-1], len(seq) - 1, 4, 1)])
        assert torch.equal(logits[0], b.oracle_logits(seq))
        seq.append(int(torch.argmax(logits[0])))
    assert seq[90:] == expect
    assert (a.calls["fetch"], a.calls["fetch_local"]) == (1, 1)
    assert (b.calls["update"], b.calls["update_local"]) == (1 + 6, 1 + 2)
    # without the local slot the sequence is not there: same block, empty ring
    c = make(w)
    c.update_kv_cache(blk, 3)
    assert not torch.equal(decode(c, [(first, 90, 3, 0)] + [idle(c, s, s) for s in (1, 2, 3)])[0],
                           c.oracle_logits(p + [first]))


# --- inputs are checked like the compiled graphs -----------------------------------------------

def test_hybrid_graphs_reject_malformed_local_tables() -> None:
    rt = make(16)
    ids = torch.zeros(1, C, dtype=torch.int64)
    pos = torch.arange(C, dtype=torch.int32)[None]
    rt.prefill(ids, pos, i16([0]), i16([3]), i16(3))
    rt.prefill(ids, pos, i16([0]), [3], 3)                       # integer lists convert
    bad = [
        (None, "needs local_block_tables"),
        (i16([[0]]), "local_block_tables must have shape"),
        (i16([0, 1]), "local_block_tables must have shape"),
        (i16([4]), r"lane ids in 0\.\.3"),
        (i16([-1]), r"lane ids in 0\.\.3"),
        (torch.tensor([0.0]), "integer"),
        (torch.tensor([70000]), "outside torch.int16"),
    ]
    for lbt, msg in bad:
        with pytest.raises(RuntimeInputError, match=msg):
            rt.prefill(ids, pos, i16([0]), lbt, i16(3))
    assert rt.calls["prefill"] == 2
    dids, dpos, dbt = (torch.zeros(4, 1, dtype=torch.int64), torch.zeros(4, 1, dtype=torch.int32),
                       i16([[7]] * 4))
    rt.decode(dids, dpos, dbt, i16([[0], [1], [2], [3]]))
    for lbt, msg in [(None, "needs local_block_tables"),
                     (i16([0, 1, 2, 3]), "local_block_tables must have shape"),
                     (i16([[0]] * 2), "local_block_tables must have shape"),
                     (i16([[0], [1], [2], [4]]), "lane ids")]:
        with pytest.raises(RuntimeInputError, match=msg):
            rt.decode(dids, dpos, dbt, lbt)
    assert rt.calls["decode"] == 1
    with pytest.raises(RuntimeInputError, match="local_block_tables=None"):
        make(None).prefill(ids, pos, i16([0]), i16([0]), i16(3))


def test_local_slot_operations_are_checked() -> None:
    rt = make(16)
    host = rt.new_local_host_buffer()
    for call in (rt.fetch_local_cache, rt.update_local_cache):
        with pytest.raises(RuntimeInputError, match="local slot 4"):
            call(host, 4)
        with pytest.raises(RuntimeInputError, match="new_local_host_buffer"):
            call(rt.new_host_buffer(), 0)           # a block buffer is not a slot buffer
        with pytest.raises(RuntimeInputError, match="new_local_host_buffer"):
            call(host.double(), 0)
    with pytest.raises(RuntimeInputError, match="new_host_buffer"):
        rt.fetch_kv_cache(host, 0)
    with pytest.raises(RuntimeInputError):
        rt.read_local(-1)
    assert rt.calls["fetch_local"] == rt.calls["update_local"] == 0
    plain = make(None)
    for op in (lambda: plain.new_local_host_buffer(), lambda: plain.read_local(0),
               lambda: plain.fetch_local_cache(host, 0), lambda: plain.update_local_cache(host, 0)):
        with pytest.raises(RuntimeInputError, match="no sliding-window layers"):
            op()


def test_spec_validation_and_tiny() -> None:
    base = dict(num_blocks=4, block_size=S, max_seq_len=S, prefill_chunk=C, batch_size=2,
                layers=3)
    for bad in (dict(sliding_window=0), dict(sliding_window=True), dict(sliding_window=2.5),
                dict(sliding_window=16, global_every=1),      # no sliding layer
                dict(sliding_window=16, global_every=4),      # no global layer in 3
                dict(sliding_window=70000), dict(global_every=0)):
        with pytest.raises(ValueError):
            RuntimeSpec(**{**base, **bad})
    cfg = Config(lanes=3, kv_blocks=4, max_seq_len=256, prefill_chunk=64)
    rt = TorchReferenceRuntime.tiny(cfg, seed=1, sliding_window=32, layers=3, global_every=3)
    assert rt.uses_local_block_tables and rt.spec.sliding_layers == (0, 1)
    assert rt.k_local[1].shape == (3, 2, 32, 16) and rt.read_local(2).shape == (2, 2, 2, 32, 16)
    assert rt.read_block(0).shape == (1, 2, 2, 256, 16)
    assert not TorchReferenceRuntime.tiny(cfg).uses_local_block_tables
