"""Config: accepts exactly what the proved capacity rules and the spec's axioms cover."""

from __future__ import annotations

import pytest

from atom_core._generated import capacity
from atom_core._generated import core as g
from atom_core.config import Config, ConfigError, min_kv_blocks, rule_for

FEATURES = [(p, s) for p in (False, True) for s in ("reserved", "dynamic")]
FEATURE_IDS = [f"{'prefix' if p else 'nocache'}-{s}" for p, s in FEATURES]


@pytest.mark.parametrize("lanes", [1, 2, 4, 7])
@pytest.mark.parametrize("prefix,scratch", FEATURES, ids=FEATURE_IDS)
def test_minimum_accepted_one_fewer_rejected(prefix, scratch, lanes):
    need = lanes + capacity.OFFSETS[(prefix, scratch)]
    assert min_kv_blocks(lanes, prefix, scratch) == need
    cfg = Config(lanes=lanes, kv_blocks=need, prefix_cache=prefix, scratch=scratch)
    assert cfg.rule == rule_for(prefix, scratch)
    assert Config(lanes=lanes, kv_blocks=need + 3, prefix_cache=prefix, scratch=scratch)
    if need - 1 < 1:
        return  # dynamic scratch without cache: kv_blocks == lanes, and 0 is not positive
    with pytest.raises(ConfigError) as e:
        Config(lanes=lanes, kv_blocks=need - 1, prefix_cache=prefix, scratch=scratch)
    msg = str(e.value)
    name = capacity.RULE_NAMES[(prefix, scratch)]
    assert name in msg  # the rule, by name ...
    assert capacity.RULES[(prefix, scratch)] in msg  # ... and form
    assert f"needs {need}" in msg
    assert "1 block missing" in msg
    assert "Fix:" in msg and f"kv_blocks >= {need}" in msg
    assert "check-config" in msg


def test_missing_blocks_plural_and_alternatives():
    with pytest.raises(ConfigError) as e:
        Config(lanes=4, kv_blocks=3, prefix_cache=True, scratch="reserved")
    msg = str(e.value)
    assert "needs 5" in msg and "2 blocks missing" in msg
    assert "lanes <= 2" in msg  # serve fewer lanes
    with pytest.raises(ConfigError) as e:
        Config(lanes=4, kv_blocks=4, prefix_cache=True, scratch="reserved")
    msg = str(e.value)
    assert "scratch='dynamic'" in msg and "which needs 4" in msg
    assert "prefix cache off" not in msg  # (the prefix cache costs no block)
    assert "lanes <= 3" in msg


def test_seeds_configuration_is_accepted():
    """The seeds' incident (one lane, two blocks, prefix cache, reserved scratch): the seeds'
    scheduler refused it; the model serves it by taking the cache entry over."""
    cfg = Config(lanes=1, kv_blocks=2, prefix_cache=True, scratch="reserved")
    assert cfg.rule == rule_for(True, "reserved")
    with pytest.raises(ConfigError, match="single-block"):
        Config(lanes=1, kv_blocks=1, prefix_cache=True, scratch="reserved")


@pytest.mark.parametrize("field", ["lanes", "kv_blocks", "max_seq_len", "block_size",
                                   "prefill_chunk"])
@pytest.mark.parametrize("bad", [0, -1, -128, 1.5, 128.0, "2", None, True, False])
def test_non_positive_or_non_int_fields(field, bad):
    kw = {"lanes": 1, "kv_blocks": 4, field: bad}
    if field == "max_seq_len":
        kw["block_size"] = 4096  # so the block_size check does not fire first
    with pytest.raises(ConfigError) as e:
        Config(**kw)
    assert f"{field} must be a positive integer" in str(e.value)
    assert repr(bad) in str(e.value)


@pytest.mark.parametrize("bad", ["fixed", "", "Reserved", None, 0])
def test_bad_scratch(bad):
    with pytest.raises(ConfigError) as e:
        Config(lanes=1, kv_blocks=4, scratch=bad)
    assert "scratch must be one of" in str(e.value)
    assert "reserved" in str(e.value) and "dynamic" in str(e.value)
    with pytest.raises(ConfigError):
        min_kv_blocks(1, False, bad)


@pytest.mark.parametrize("chunk", [32, 100, 130, 4000])
def test_prefill_chunk_must_be_a_multiple_of_64(chunk):
    with pytest.raises(ConfigError) as e:
        Config(lanes=1, kv_blocks=4, prefill_chunk=chunk, max_seq_len=8000, block_size=8000)
    assert f"prefill_chunk={chunk} is not a multiple of 64" in str(e.value)


@pytest.mark.parametrize("chunk,block", [(128, 4000), (192, 4096), (256, 4160)])
def test_a_paged_block_size_must_be_a_multiple_of_prefill_chunk(chunk, block):
    with pytest.raises(ConfigError) as e:
        Config(lanes=1, kv_blocks=4, prefill_chunk=chunk, max_seq_len=2 * block,
               block_size=block)
    msg = str(e.value)
    assert "chunk_divides_block" in msg
    assert "must be a multiple of prefill_chunk" in msg


@pytest.mark.parametrize("chunk,seq_len", [(128, 4000), (192, 4096), (256, 4160)])
def test_an_eager_max_seq_len_need_not_be_a_multiple_of_prefill_chunk(chunk, seq_len):
    """As optimum-rbln: the last chunk of a prompt is padded."""
    cfg = Config(lanes=1, kv_blocks=4, prefill_chunk=chunk, max_seq_len=seq_len)
    assert cfg.block_size == seq_len and cfg.blocks_per_table == 1


def test_chunk_larger_than_block():
    with pytest.raises(ConfigError) as e:
        Config(lanes=1, kv_blocks=4, prefill_chunk=128, max_seq_len=64)
    assert "prefill_chunk must not exceed block_size" in str(e.value)


@pytest.mark.parametrize("block_size", [96, 3000, 8192])
def test_block_size_must_divide_max_seq_len(block_size):
    with pytest.raises(ConfigError) as e:
        Config(lanes=1, kv_blocks=4, block_size=block_size, prefill_chunk=64)
    msg = str(e.value)
    assert f"max_seq_len=4096 is not a multiple of block_size={block_size}" in msg


@pytest.mark.parametrize("lanes,block_size,prefix,scratch,want", [
    (1, 1024, False, "dynamic", 4),   # one whole table of T = 4
    (2, 2048, True, "reserved", 5),   # 2 tables of 2, scratch; the hit's source fits meanwhile
    (3, 512, True, "dynamic", 24),    # 3 tables of 8
    (2, 2048, False, "reserved", 5),
])
def test_paged_tables_need_a_whole_table_per_lane(lanes, block_size, prefix, scratch, want):
    """T = max_seq_len / block_size blocks per lane, plus the scratch block; with T > 1 a
    prefix hit's pinned source needs no block of its own (the admitted lane holds one block of
    its table while the copy runs)."""
    t = 4096 // block_size
    need = min_kv_blocks(lanes, prefix, scratch, t)
    assert need == want
    cfg = Config(lanes=lanes, kv_blocks=need, block_size=block_size, prefix_cache=prefix,
                 scratch=scratch)
    assert cfg.blocks_per_table == t and cfg.consts().T == t and cfg.consts().S == block_size
    with pytest.raises(ConfigError) as e:
        Config(lanes=lanes, kv_blocks=need - 1, block_size=block_size, prefix_cache=prefix,
               scratch=scratch)
    assert f"needs {need}, 1 block missing" in str(e.value)


def test_paged_tables_with_a_hybrid_model():
    """A full block keeps its lane's snapshots, so a hybrid model's tables may have several
    blocks, with the same rule as a plain model's."""
    need = min_kv_blocks(2, True, "reserved", 4)
    cfg = Config(lanes=2, kv_blocks=need, block_size=1024, sliding_window=512,
                 prefix_cache=True, scratch="reserved")
    assert cfg.consts().T == 4 and cfg.consts().HYBRID
    with pytest.raises(ConfigError) as e:
        Config(lanes=2, kv_blocks=need - 1, block_size=1024, sliding_window=512,
               prefix_cache=True, scratch="reserved")
    assert "1 block missing" in str(e.value)


def test_paged_tables_with_a_host_tier():
    """The host tier keeps one block per entry at its position (`slot_start`), so paged tables
    need no more device blocks with it than without."""
    cfg = Config(lanes=2, kv_blocks=min_kv_blocks(2, True, "dynamic", 4), block_size=1024,
                 prefix_cache=True, host_cache_blocks=8)
    assert cfg.consts().T == 4 and cfg.consts().HOST and cfg.consts().H == 8
    with pytest.raises(ConfigError) as e:
        Config(lanes=2, kv_blocks=cfg.kv_blocks - 1, block_size=1024, prefix_cache=True,
               host_cache_blocks=8)
    assert "1 block missing" in str(e.value)


@pytest.mark.parametrize("kw", [
    {"scratch": "dynamic", "scratch_block": 0},  # only meaningful with a reserved block
    {"scratch": "reserved", "scratch_block": 4},
    {"scratch": "reserved", "scratch_block": -1},
    {"scratch": "reserved", "scratch_block": 100},
], ids=["dynamic", "past-end", "negative", "far"])
def test_bad_scratch_block(kw):
    with pytest.raises(ConfigError) as e:
        Config(lanes=1, kv_blocks=4, **kw)
    msg = str(e.value)
    assert f"scratch_block={kw['scratch_block']}" in msg
    assert "scratch='reserved'" in msg and "0..3" in msg


def test_scratch_block_default_and_explicit():
    assert Config(lanes=1, kv_blocks=4, scratch="reserved").consts().SCRATCH == 3
    assert Config(lanes=1, kv_blocks=4, scratch="reserved", scratch_block=0).consts().SCRATCH == 0


@pytest.mark.parametrize("bad", [0.5, True])
def test_scratch_block_must_be_an_int(bad):
    with pytest.raises(ConfigError):
        Config(lanes=1, kv_blocks=4, scratch="reserved", scratch_block=bad)


def test_prefix_cache_must_be_a_bool():
    with pytest.raises(ConfigError):
        Config(lanes=1, kv_blocks=4, prefix_cache="no")


@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("prefix,scratch", FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize("chunk,seq_len", [(64, 128), (128, 4096), (256, 8192)])
def test_consts_satisfy_the_axioms(prefix, scratch, lanes, chunk, seq_len):
    cfg = Config(lanes=lanes, kv_blocks=min_kv_blocks(lanes, prefix, scratch),
                 prefill_chunk=chunk, max_seq_len=seq_len, prefix_cache=prefix, scratch=scratch)
    c = cfg.consts()
    assert g.check_axioms(c) == []
    assert (c.B, c.K, c.C, c.S) == (lanes, cfg.kv_blocks, chunk, seq_len)
    assert (c.PREFIX, c.RESERVED) == (prefix, scratch == "reserved")
    assert 0 <= c.SCRATCH < c.K
