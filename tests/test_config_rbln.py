"""Config.from_rbln: optimum-rbln / vllm-rbln names, conflicts, and the CLI's --rbln-config."""

import json

import pytest

from atom_core.cli import main
from atom_core.config import Config, ConfigError

ARTIFACT = {"batch_size": 4, "max_seq_len": 1024, "kvcache_block_size": 256,
            "kvcache_num_blocks": 16, "prefill_chunk_size": 128,
            "decoder_batch_sizes": [4, 2, 1], "tensor_parallel_size": 4, "model_id": "x"}


def test_from_rbln_reads_optimum_rbln_names(tmp_path):
    (tmp_path / "rbln_config.json").write_text(json.dumps(ARTIFACT))
    for src in (tmp_path, tmp_path / "rbln_config.json", ARTIFACT):
        cfg = Config.from_rbln(src)
        assert (cfg.lanes, cfg.kv_blocks, cfg.max_seq_len, cfg.block_size, cfg.prefill_chunk) \
            == (4, 16, 1024, 256, 128)
    assert Config.from_rbln(ARTIFACT, preemption=True).preemption


def test_from_rbln_vllm_names_and_nested():
    cfg = Config.from_rbln({"language_model": {
        "max_num_seqs": 2, "num_gpu_blocks_override": 3, "max_model_len": 128,
        "block_size": 128, "prefill_chunk_size": 64, "enable_prefix_caching": True}})
    assert (cfg.lanes, cfg.kv_blocks, cfg.max_seq_len, cfg.prefix_cache) == (2, 3, 128, True)


def test_from_rbln_conflicts_and_checks_name_both():
    with pytest.raises(ConfigError, match="batch_size=4 and max_num_seqs=8 conflict"):
        Config.from_rbln({**ARTIFACT, "max_num_seqs": 8})
    # agreeing aliases are fine
    assert Config.from_rbln({**ARTIFACT, "max_model_len": 1024}).max_seq_len == 1024
    with pytest.raises(ConfigError, match="decoder_batch_sizes"):
        Config.from_rbln({**ARTIFACT, "decoder_batch_sizes": [8, 4]})
    with pytest.raises(ConfigError, match="kvcache_num_blocks"):
        Config.from_rbln({k: v for k, v in ARTIFACT.items() if k != "kvcache_num_blocks"})
    # the capacity rule still applies to what the file says
    with pytest.raises(ConfigError, match="too few"):
        Config.from_rbln({**ARTIFACT, "kvcache_num_blocks": 15})


def test_cli_rbln_config(tmp_path, capsys):
    path = tmp_path / "rbln_config.json"
    path.write_text(json.dumps({**ARTIFACT, "kvcache_num_blocks": 15}))
    assert main(["check-config", "--rbln-config", str(path), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["safe"], out["lanes"], out["kv_blocks"], out["min_kv_blocks"]) == \
        (False, 4, 15, 16)
    # a flag wins over the file
    assert main(["check-config", "--rbln-config", str(path), "--kv-blocks", "16"]) == 0
    assert main(["min-blocks", "--rbln-config", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["min_kv_blocks"] == 16
    with pytest.raises(SystemExit) as exc:
        main(["check-config", "--lanes", "2"])
    assert exc.value.code == 2
    assert "--kv-blocks required" in capsys.readouterr().err


def test_from_rbln_sliding_window_follows_cache_impl():
    hybrid = {**ARTIFACT, "cache_impl": "hybrid", "sliding_window": 64}
    assert Config.from_rbln(hybrid).sliding_window == 64
    assert Config.from_rbln({**hybrid, "cache_impl": "static"}).sliding_window is None
    with pytest.raises(ConfigError, match="cache_impl='sliding_window'"):
        Config.from_rbln({**hybrid, "cache_impl": "sliding_window"})


def test_from_rbln_refuses_an_uncompiled_block_estimate():
    """kvcache_num_blocks=0 is optimum-rbln's "estimate when compiling", not a block count."""
    with pytest.raises(ConfigError, match="kvcache_num_blocks=0 asks optimum-rbln to estimate"):
        Config.from_rbln({**ARTIFACT, "kvcache_num_blocks": 0})
    assert Config.from_rbln({**ARTIFACT, "kvcache_num_blocks": 0}, kv_blocks=16).kv_blocks == 16
