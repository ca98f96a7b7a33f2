"""The torch reference runtime: RBLN graph semantics, block isolation, and exact agreement of the
cached path (prefill + decode through block tables) with the cache-free oracle `generate`."""

from __future__ import annotations

import pytest
import torch

from atom_core.config import Config
from atom_core.runtime import Runtime, RuntimeInputError, RuntimeSpec, TorchReferenceRuntime

C = 64
S = 256


def make(dtype: torch.dtype = torch.float32, seed: int = 0, **kw) -> TorchReferenceRuntime:
    base = dict(num_blocks=8, block_size=S, max_seq_len=S, prefill_chunk=C, batch_size=4)
    base.update(kw)
    return TorchReferenceRuntime(RuntimeSpec(**base), seed=seed, dtype=dtype)


def prompt(n: int, seed: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def i16(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int16)


def prefill(rt: TorchReferenceRuntime, tokens: list[int], table: list[int],
            start: int = 0) -> torch.Tensor:
    """Prefill tokens[start:] chunk by chunk through `table` (T entries); last logits [V]."""
    bt = i16(table)
    logits = None
    for s in range(start, len(tokens), C):
        chunk = tokens[s:s + C]
        ids = torch.tensor([chunk + [0] * (C - len(chunk))])
        pos = torch.arange(s, s + C, dtype=torch.int32)[None]
        logits = rt.prefill(ids, pos, bt, None, i16(len(chunk) - 1))
    assert logits is not None and logits.shape == (1, 1, rt.vocab_size)
    return logits[0, 0]


def serve(rt: TorchReferenceRuntime, requests: list[tuple[list[int], int]],
          tables: list[list[int]], scratch: int, exact: bool = False,
          rows: int | None = None) -> list[list[int]]:
    """A minimal lane scheduler: lane l always uses block table tables[l]; requests are admitted
    in order into free lanes (one prefill per step), all lanes decode together and idle lanes
    point at the scratch block. A lane's block is reused by the next request as is (with the
    previous request's KV in it). With `exact`, every busy row's logits must equal the oracle's
    bit for bit."""
    rows = rows or rt.batch_size
    t = rt.max_seq_len // rt.block_size
    waiting = list(range(len(requests)))
    lane_req: list[int | None] = [None] * rows
    seqs: dict[int, list[int]] = {}
    outs: dict[int, list[int]] = {i: [] for i in range(len(requests))}

    def done(i: int) -> bool:   # len(seqs[i]) - 1 tokens have KV; the last has none yet
        return len(outs[i]) >= requests[i][1] or len(seqs[i]) > rt.max_seq_len

    while waiting or any(r is not None for r in lane_req):
        free = [lane for lane in range(rows) if lane_req[lane] is None]
        if waiting and free:
            i, lane = waiting.pop(0), free[0]
            seqs[i] = list(requests[i][0])
            logits = prefill(rt, seqs[i], tables[lane])
            if exact:
                assert torch.equal(logits, rt.oracle_logits(seqs[i]))
            tok = int(torch.argmax(logits))
            outs[i].append(tok)
            seqs[i].append(tok)
            lane_req[lane] = None if done(i) else i
            continue
        ids, pos, bt = [], [], []
        for lane in range(rows):
            i = lane_req[lane]
            if i is None:
                ids.append([lane * 7 % rt.vocab_size])
                pos.append([3 * lane])
                bt.append([scratch] * t)
            else:
                ids.append([seqs[i][-1]])
                pos.append([len(seqs[i]) - 1])
                bt.append(tables[lane])
        logits = rt.decode(torch.tensor(ids), torch.tensor(pos, dtype=torch.int32), i16(bt), None)
        assert logits.shape == (rows, 1, rt.vocab_size)
        for lane in range(rows):
            i = lane_req[lane]
            if i is None:
                continue
            if exact:
                assert torch.equal(logits[lane, 0], rt.oracle_logits(seqs[i]))
            tok = int(torch.argmax(logits[lane, 0]))
            outs[i].append(tok)
            seqs[i].append(tok)
            if done(i):
                lane_req[lane] = None
    return [outs[i] for i in range(len(requests))]


# --- the oracle --------------------------------------------------------------------------------

def test_oracle_is_deterministic_and_seeded() -> None:
    p = prompt(30, 1)
    a, b = make(seed=3), make(seed=3)
    assert a.generate(p, 12) == b.generate(p, 12) == a.generate(p, 12)
    assert torch.equal(a.oracle_logits(p), b.oracle_logits(p))
    assert not torch.equal(make(seed=4).oracle_logits(p), a.oracle_logits(p))
    out = a.generate(p, 12)
    assert len(out) == 12 and all(0 <= t < 128 for t in out)
    assert len(set(out)) > 1


def test_generate_stops_at_eos_and_max_seq_len() -> None:
    rt = make()
    p = prompt(20, 2)
    full = rt.generate(p, 10)
    eos = full[3]
    first = full.index(eos)
    assert rt.generate(p, 10, eos_token_id=eos) == full[:first + 1]
    assert len(rt.generate(prompt(S - 3, 3), 10)) == 4     # the last from position S - 1
    assert len(rt.generate(prompt(S, 3), 10)) == 1
    with pytest.raises(ValueError):
        rt.generate([], 3)


# --- cached path == oracle ---------------------------------------------------------------------

def test_prefill_logits_equal_oracle_exactly() -> None:
    rt = make()
    for n in (1, 2, 63, 64, 65, 130, 200, S):
        p = prompt(n, n)
        assert torch.equal(prefill(rt, p, [n % 8]), rt.oracle_logits(p)), n


def test_lanes_decoded_together_match_generate_exactly() -> None:
    rt = make()
    lengths = [1, 5, 64, 100, 150, 37, 240]
    new = [14, 20, 6, 16, 24, 9, 30]           # the last one runs into max_seq_len
    reqs = [(prompt(n, i), k) for i, (n, k) in enumerate(zip(lengths, new, strict=True))]
    # lanes use blocks 4, 0, 2, 1; block 7 is the scratch; seven requests reuse the four lanes
    outs = serve(rt, reqs, tables=[[4], [0], [2], [1]], scratch=7, exact=True)
    for (p, k), out in zip(reqs, outs, strict=True):
        assert out == rt.generate(p, k)
    assert len(outs[-1]) == S + 1 - 240


def test_paged_block_tables_match_generate() -> None:
    rt = make(block_size=64, num_blocks=10)   # T = 4 blocks of 64 per sequence
    reqs = [(prompt(150, 7), 30), (prompt(70, 8), 20), (prompt(3, 9), 12)]
    # entries past a sequence's end repeat its last block: every entry a graph sees is a block
    # id (optimum-rbln never passes -1), and nothing is read or written there
    tables = [[5, 2, 7, 0], [1, 3, 3, 3], [8, 8, 8, 8], [9, 9, 9, 9]]
    outs = serve(rt, reqs, tables=tables, scratch=9, rows=4)
    for (p, k), out in zip(reqs, outs, strict=True):
        assert out == rt.generate(p, k)


def test_float64_mode_matches_oracle_and_float32() -> None:
    rt64, rt32 = make(torch.float64), make(torch.float32)
    assert rt64.k_cache[0].dtype == torch.float64
    reqs = [(prompt(90, 11), 15), (prompt(10, 12), 10)]
    outs64 = serve(rt64, reqs, tables=[[0], [1], [2], [3]], scratch=7, exact=True)
    outs32 = serve(rt32, reqs, tables=[[0], [1], [2], [3]], scratch=7)
    assert outs64 == outs32 == [rt64.generate(p, k) for p, k in reqs]
    p = prompt(40, 13)
    l64 = rt64.oracle_logits(p)
    assert l64.dtype == torch.float64
    assert torch.equal(l64.to(torch.float32), rt32.oracle_logits(p))


def test_junk_in_blocks_never_matters() -> None:
    """Blocks full of junk (NaN and inf included) past a sequence's length change nothing."""
    rt = make()
    g = torch.Generator().manual_seed(5)
    for b in range(rt.num_blocks):
        junk = torch.randn(rt.new_host_buffer().shape, generator=g) * 1e6
        junk[..., ::7, :] = float("nan")
        junk[..., 3::11, :] = float("inf")
        rt.update_kv_cache(junk, b)
    reqs = [(prompt(70, 21), 12), (prompt(5, 22), 12)]
    outs = serve(rt, reqs, tables=[[3], [6], [0], [1]], scratch=7, exact=True)
    assert outs == [rt.generate(p, k) for p, k in reqs]


def test_a_corrupted_live_position_changes_the_logits() -> None:
    """The exact-equality checks have teeth: one wrong cached position shows."""
    rt = make()
    p = prompt(50, 31)
    prefill(rt, p, [2])
    host = rt.new_host_buffer()
    rt.fetch_kv_cache(host, 2)
    host[1, 1, 0, 17] += 1.0      # layer 1, V, kv head 0, position 17
    rt.update_kv_cache(host, 2)
    seq = p + [5]
    logits = rt.decode(torch.tensor([[5]] * 4), torch.tensor([[50]] * 4, dtype=torch.int32),
                       i16([[2], [7], [7], [7]]), None)
    assert not torch.equal(logits[0, 0], rt.oracle_logits(seq))


# --- writes land only where the tables say -------------------------------------------------------

def _positions_changed(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    diff = (before != after).any(dim=4).any(dim=2).any(dim=1).any(dim=0)   # over positions
    return {int(i) for i in torch.nonzero(diff)}


def _fill(rt: TorchReferenceRuntime, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in range(rt.num_blocks):
        rt.update_kv_cache(torch.randn(rt.new_host_buffer().shape, generator=g), b)


def test_padding_rows_write_only_their_target() -> None:
    rt = make()
    _fill(rt, 1)
    p = prompt(40, 41)
    prefill(rt, p, [2])
    before = [rt.read_block(b) for b in range(rt.num_blocks)]
    rt.decode(torch.tensor([[9], [1], [2], [3]]),
              torch.tensor([[40], [0], [5], [9]], dtype=torch.int32),
              i16([[2], [7], [7], [7]]), None)
    after = [rt.read_block(b) for b in range(rt.num_blocks)]
    for b in range(rt.num_blocks):
        if b not in (2, 7):
            assert torch.equal(before[b], after[b]), b
    assert _positions_changed(before[2], after[2]) == {40}
    assert _positions_changed(before[7], after[7]) == {0, 5, 9}


def test_prefill_writes_the_whole_chunk_and_nothing_else() -> None:
    rt = make(block_size=64, num_blocks=8)
    _fill(rt, 2)
    before = [rt.read_block(b) for b in range(rt.num_blocks)]
    p = prompt(64 + 10, 42)
    prefill(rt, p, [3, 5, 5, 5])   # chunk 0 -> block 3, chunk 1 (10 valid + 54 padding) -> 5
    after = [rt.read_block(b) for b in range(rt.num_blocks)]
    for b in range(rt.num_blocks):
        if b not in (3, 5):
            assert torch.equal(before[b], after[b]), b
    # like the device, padding positions of the last chunk are computed and written too
    assert _positions_changed(before[3], after[3]) == set(range(64))
    assert _positions_changed(before[5], after[5]) == set(range(64))


def test_decode_on_a_smaller_graph_computes_only_its_rows() -> None:
    rt = make(decoder_batch_sizes=(4, 2, 1))
    assert rt.decoder_batch_sizes == (4, 2, 1)
    assert rt.decode_batch_size([]) == 1
    assert rt.decode_batch_size([0]) == 1
    assert rt.decode_batch_size([1]) == 2
    assert rt.decode_batch_size([0, 1]) == 2
    assert rt.decode_batch_size([0, 2]) == 4
    assert rt.decode_batch_size({3}) == 4
    with pytest.raises(RuntimeInputError):
        rt.decode_batch_size([4])
    p = prompt(30, 51)
    prefill(rt, p, [1])
    before = [rt.read_block(b) for b in range(rt.num_blocks)]
    logits = rt.decode(torch.tensor([[4], [0]]), torch.tensor([[30], [0]], dtype=torch.int32),
                       i16([[1], [7]]), None)
    assert logits.shape == (2, 1, 128)
    assert torch.equal(logits[0, 0], rt.oracle_logits(p + [4]))
    after = [rt.read_block(b) for b in range(rt.num_blocks)]
    assert [b for b in range(rt.num_blocks) if not torch.equal(before[b], after[b])] == [1, 7]
    with pytest.raises(RuntimeInputError, match="no decode graph has 3 rows"):
        rt.decode(torch.zeros(3, 1, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int32),
                  i16([[7]] * 3), None)
    with pytest.raises(RuntimeInputError, match="block_tables must have shape"):
        rt.decode(torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int32),
                  i16([[7]] * 4), None)


# --- block operations --------------------------------------------------------------------------

def test_copy_kv_cache_copies_exactly_num_tokens() -> None:
    rt = make()
    _fill(rt, 3)
    before = [rt.read_block(b) for b in range(rt.num_blocks)]
    rt.copy_kv_cache(1, 2, 40)
    after = [rt.read_block(b) for b in range(rt.num_blocks)]
    assert torch.equal(after[2][..., :40, :], before[1][..., :40, :])
    assert torch.equal(after[2][..., 40:, :], before[2][..., 40:, :])
    assert all(torch.equal(before[b], after[b]) for b in range(rt.num_blocks) if b != 2)
    rt.copy_kv_cache(3, 4, 0)
    assert torch.equal(rt.read_block(4), before[4])
    rt.copy_kv_cache(3, 4, S)
    assert torch.equal(rt.read_block(4), before[3])
    for bad in ((1, 1, 5), (1, 8, 5), (-1, 2, 5), (1, 2, S + 1), (1, 2, -1)):
        with pytest.raises(RuntimeInputError):
            rt.copy_kv_cache(*bad)
    assert rt.calls["copy"] == 3


def test_prefix_hit_by_copy_then_prefill_from_a_chunk_boundary() -> None:
    rt = make()
    a = prompt(100, 61)
    b = a[:C] + prompt(30, 62)            # shares one full chunk with a
    assert serve(rt, [(a, 10)], tables=[[1], [0], [2], [3]], scratch=7) == [rt.generate(a, 10)]
    rt.copy_kv_cache(1, 5, C)             # the hit: block 1 holds a's KV
    logits = prefill(rt, b, [5], start=C)
    assert torch.equal(logits, rt.oracle_logits(b))


def test_fetch_update_round_trip_and_swap_in_elsewhere() -> None:
    rt = make()
    p = prompt(80, 71)
    expect = rt.generate(p, 12)
    seq = p + [int(torch.argmax(prefill(rt, p, [1])))]
    host = rt.new_host_buffer()
    rt.fetch_kv_cache(host, 1)
    assert torch.equal(host, rt.read_block(1))
    _fill(rt, 4)                          # everything on the device is clobbered
    rt.update_kv_cache(host, 6)           # swap in to another block
    assert torch.equal(rt.read_block(6), host)
    while len(seq) < len(p) + 12:
        logits = rt.decode(torch.tensor([[seq[-1]], [0], [0], [0]]),
                           torch.tensor([[len(seq) - 1], [0], [0], [0]], dtype=torch.int32),
                           i16([[6], [7], [7], [7]]), None)
        seq.append(int(torch.argmax(logits[0, 0])))
    assert seq[len(p):] == expect
    with pytest.raises(RuntimeInputError):
        rt.fetch_kv_cache(torch.zeros(3), 1)
    with pytest.raises(RuntimeInputError):
        rt.update_kv_cache(host.double(), 1)
    with pytest.raises(RuntimeInputError):
        rt.fetch_kv_cache(host, 8)


# --- inputs are checked like the compiled graphs -----------------------------------------------

def test_prefill_rejects_malformed_inputs() -> None:
    rt = make()
    ids = torch.zeros(1, C, dtype=torch.int64)
    pos = torch.arange(C, dtype=torch.int32)[None]
    ok = (ids, pos, i16([0]), None, i16(3))
    rt.prefill(*ok)
    rt.prefill(ids.int(), pos.long(), torch.tensor([0]), None, 3)   # integer dtypes convert
    bad = [
        ((ids.float(), *ok[1:]), "integer"),
        ((ids[:, :32], *ok[1:]), "input_ids must have shape"),
        ((ids, pos + 1, *ok[2:]), "multiple of the chunk size"),
        ((ids, pos.flip(1), *ok[2:]), "multiple of the chunk size"),
        ((ids, pos + S, *ok[2:]), "multiple of the chunk size"),
        ((ids, pos, i16([[0]]), None, i16(3)), "block_tables must have shape"),
        ((ids, pos, i16([8]), None, i16(3)), "block id outside"),
        ((ids, pos, i16([0]), i16([0]), i16(3)), "local_block_tables=None"),
        ((ids, pos, i16([0]), None, i16(C)), "query_position"),
        ((ids, pos, i16([0]), None, i16([3])), "query_position must have shape"),
        ((ids, pos, torch.tensor([70000]), None, i16(3)), "outside torch.int16"),
    ]
    for args, msg in bad:
        with pytest.raises(RuntimeInputError, match=msg):
            rt.prefill(*args)
    assert rt.calls["prefill"] == 2


def test_decode_rejects_malformed_inputs() -> None:
    rt = make()
    ids = torch.zeros(4, 1, dtype=torch.int64)
    pos = torch.zeros(4, 1, dtype=torch.int32)
    bt = i16([[7]] * 4)
    rt.decode(ids, pos, bt, None)
    bad = [
        ((ids[:, 0], pos, bt, None), "input_ids must have shape"),
        ((ids, pos[:, 0], bt, None), "cache_position must have shape"),
        ((ids, pos + S, bt, None), "outside 0..255"),
        ((ids, pos, i16([[7], [7], [7], [-1]]), None), "block id outside"),
        ((ids, pos, bt, i16([[0]] * 4)), "local_block_tables=None"),
    ]
    for args, msg in bad:
        with pytest.raises(RuntimeInputError, match=msg):
            rt.decode(*args)


# --- construction ------------------------------------------------------------------------------

def test_tiny_from_config_and_protocol() -> None:
    cfg = Config(lanes=3, kv_blocks=4, max_seq_len=256, prefill_chunk=64)
    rt = TorchReferenceRuntime.tiny(cfg, seed=1)
    assert isinstance(rt, Runtime)
    assert (rt.batch_size, rt.num_blocks, rt.block_size, rt.max_seq_len, rt.prefill_chunk) == \
        (3, 4, 256, 256, 64)
    assert rt.decoder_batch_sizes == (3,) and rt.vocab_size == 128
    assert rt.k_cache[0].shape == (4, 2, 256, 16)
    assert rt.read_block(0).shape == (2, 2, 2, 256, 16)
    big = TorchReferenceRuntime.tiny(cfg, layers=3, vocab_size=200, decoder_batch_sizes=(3, 1))
    assert big.vocab_size == 200 and len(big.k_cache) == 3 and big.decoder_batch_sizes == (3, 1)


def test_spec_validation() -> None:
    base = dict(num_blocks=4, block_size=S, max_seq_len=S, prefill_chunk=C, batch_size=2)
    for bad in (dict(block_size=100), dict(block_size=S // 2, prefill_chunk=S // 2 + 64),
                dict(heads=3),
                dict(head_dim=15), dict(decoder_batch_sizes=(1,)), dict(num_blocks=0),
                dict(num_blocks=40000), dict(batch_size=True)):
        with pytest.raises(ValueError):
            RuntimeSpec(**{**base, **bad})
    assert RuntimeSpec(**base, decoder_batch_sizes=[1, 2, 2]).decoder_batch_sizes == (2, 1)
    # an eager block need not be a multiple of the chunk (the last chunk is padded)
    assert RuntimeSpec(**{**base, "prefill_chunk": 96}).prefill_chunk == 96
    with pytest.raises(ValueError):
        TorchReferenceRuntime(RuntimeSpec(**base), dtype=torch.float16)
