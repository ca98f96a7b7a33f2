"""Audit of Config / rbln_config.json / check-config and min-blocks: every user error is a
ConfigError (or exit 2 with a message), never a traceback, and says what to change."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import numpy as np
import pytest

from atom_core._generated import core as g
from atom_core.cli import main
from atom_core.config import CONST_FIELDS, Config, ConfigError, axiom_fields, rbln_fields

GOOD = {"batch_size": 2, "kvcache_num_blocks": 64, "max_seq_len": 1024}


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "rbln_config.json"
    path.write_text(json.dumps(data))
    return path


def test_numpy_int_is_refused_with_the_conversion_to_make() -> None:
    # np.int64(128) is positive: the message must say why it is refused, not only "positive"
    with pytest.raises(ConfigError, match=r"lanes must be a positive integer, got np.int64\(2\)"
                       r" \(a numpy.int64, not a Python int: pass int\(value\)\)"):
        Config(lanes=np.int64(2), kv_blocks=8)


def test_axiom_failure_names_the_values() -> None:
    with pytest.raises(ConfigError, match=r"block_holds_a_chunk.*\(here block_size=128, "
                                          r"max_seq_len=1024, prefill_chunk=256\)"):
        Config(lanes=2, kv_blocks=64, max_seq_len=1024, block_size=128, prefill_chunk=256)
    with pytest.raises(ConfigError, match=r"preemption_with_tables.*\(here preemption=True"):
        Config(lanes=2, kv_blocks=64, max_seq_len=1024, preemption=True)


def _raw(**fields: object) -> Config:
    """A Config with these field values, past its validation: `consts` on any values."""
    c = object.__new__(Config)
    for name, value in fields.items():
        object.__setattr__(c, name, value)
    return c


# Each field's value, and another it may take.
_BASE = {"lanes": 2, "kv_blocks": 64, "max_seq_len": 1024, "block_size": 256,
         "prefill_chunk": 128, "prefix_cache": True, "scratch": "dynamic", "scratch_block": None,
         "sliding_window": None, "host_cache_blocks": 0, "preemption": False}
_OTHER = {"lanes": 3, "kv_blocks": 65, "max_seq_len": 2048, "block_size": 512,
          "prefill_chunk": 64, "prefix_cache": False, "scratch": "reserved", "scratch_block": 5,
          "sliding_window": 512, "host_cache_blocks": 4, "preemption": True}


def test_const_fields_are_what_consts_reads() -> None:
    """CONST_FIELDS (which settings an axiom failure names) matches `Config.consts`: every
    field that changes a constant is listed under it, and every listed field changes it in some
    configuration. A constant added to the spec without an entry fails here too."""
    assert set(CONST_FIELDS) == {f.name for f in attrs.fields(g.Consts)}
    assert set(_BASE) == {f.name for f in attrs.fields(Config)}
    seen: set[tuple[str, str]] = set()
    for base in (_BASE, _OTHER):
        before = attrs.asdict(_raw(**base).consts())
        for name in base:
            other = _OTHER[name] if base is _BASE else _BASE[name]
            after = attrs.asdict(_raw(**{**base, name: other}).consts())
            for const in before:
                if before[const] != after[const]:
                    assert name in CONST_FIELDS[const], (name, const)
                    seen.add((const, name))
    assert seen == {(c, f) for c, fs in CONST_FIELDS.items() for f in fs}


def test_axiom_fields_follow_the_constants_each_axiom_reads() -> None:
    assert axiom_fields(["block_holds_a_chunk"]) == ["prefill_chunk", "block_size"]
    assert axiom_fields(["hybrid_without_host_cache", "host_cache_needs_prefix_cache"]) == [
        "sliding_window", "host_cache_blocks", "prefix_cache"]
    # every axiom that reads a constant names a setting
    assert all(axiom_fields([a]) for a in g.AXIOM_CONSTS)


def test_rbln_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "rbln_config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match="is not a UTF-8 text file"):
        rbln_fields(tmp_path)


def test_rbln_unreadable_path_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "rbln_config.json").mkdir()  # a directory where the file should be
    with pytest.raises(ConfigError, match="cannot read .*rbln_config.json: Is a directory"):
        Config.from_rbln(tmp_path)


def test_rbln_source_of_wrong_type_is_a_config_error() -> None:
    for bad in (None, 5):
        with pytest.raises(ConfigError, match="rbln_config must be a dict of settings"):
            rbln_fields(bad)


@pytest.mark.parametrize("key,value,why", [
    ("batch_size", "2", r"batch_size='2' must be a positive integer \(it sets lanes\)"),
    ("batch_size", 2.0, r"batch_size=2.0 must be a positive integer"),
    # (0 blocks is optimum-rbln's "estimate when compiling": refused by `estimate_message`)
    ("kvcache_num_blocks", True, r"kvcache_num_blocks=True must be a non-negative integer"),
    ("max_seq_len", -1, r"max_seq_len=-1 must be a positive integer"),
    ("enable_prefix_caching", "true", r"enable_prefix_caching='true' must be true or false"),
    ("decoder_batch_sizes", [1, "x"], r"decoder_batch_sizes=\[1, 'x'\] must be a non-empty list"),
    ("decoder_batch_sizes", "abc", r"decoder_batch_sizes='abc' must be a non-empty list"),
])
def test_rbln_field_of_wrong_type_names_the_key(tmp_path: Path, key: str, value: object,
                                                why: str) -> None:
    path = write(tmp_path, {**GOOD, key: value})
    with pytest.raises(ConfigError, match=why):
        rbln_fields(path)
    # check-config did arithmetic on the value (a TypeError traceback): now exit 2, said why
    assert main(["check-config", "--rbln-config", str(path)]) == 2
    assert main(["min-blocks", "--rbln-config", str(path)]) == 2


def test_check_config_rbln_errors_are_json_with_json(tmp_path: Path, capsys) -> None:
    (tmp_path / "rbln_config.json").write_bytes(b"\xff")
    capsys.readouterr()
    assert main(["check-config", "--rbln-config", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["safe"] is False and "not a UTF-8 text file" in out["error"]
    assert "INVALID" in captured.err
    assert main(["min-blocks", "--rbln-config", str(tmp_path / "missing"), "--json"]) == 2
    assert "does not exist" in json.loads(capsys.readouterr().out)["error"]


def test_missing_lanes_with_json_is_json_and_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["check-config", "--json"])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert "--lanes and --kv-blocks required" in json.loads(captured.out)["error"]
    assert "--lanes and --kv-blocks required" in captured.err


def test_check_config_estimate_blocks_is_refused_not_searched(tmp_path: Path, capsys) -> None:
    # kvcache_num_blocks=0 went into the stuck-run search (a z3 traceback)
    path = write(tmp_path, {**GOOD, "kvcache_num_blocks": 0})
    assert main(["check-config", "--rbln-config", str(path), "--json"]) == 2
    assert "asks optimum-rbln to estimate" in json.loads(capsys.readouterr().out)["error"]
    # a --kv-blocks flag gives the count the file does not
    assert main(["check-config", "--rbln-config", str(path), "--kv-blocks", "4"]) == 0


def test_check_config_refuses_what_config_refuses_for_a_hybrid_artifact(tmp_path: Path,
                                                                        capsys) -> None:
    path = write(tmp_path, {**GOOD, "cache_impl": "hybrid", "sliding_window": 64})
    with pytest.raises(ConfigError, match="hybrid_without_host_cache"):
        Config.from_rbln(path, prefix_cache=True, host_cache_blocks=2)
    capsys.readouterr()
    code = main(["check-config", "--rbln-config", str(path), "--prefix-cache",
                 "--host-cache-blocks", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["safe"] is False and "hybrid_without_host_cache" in out["error"]
    assert main(["check-config", "--rbln-config", str(path)]) == 0
