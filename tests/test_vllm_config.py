"""atom_core.vllm without vLLM: the package imports (the core never needs vLLM), vLLM's settings
become a Config checked against the proved capacity rule, and each refusal says what to change
in vLLM's flags. (AtomScheduler itself runs in vLLM's engine: tests_vllm/.)"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from atom_core.config import ConfigError, min_kv_blocks
from atom_core.vllm import config_from_vllm


def settings(seqs: int = 4, max_len: int = 256, block: int = 64,
             prefix: bool = False) -> SimpleNamespace:
    """The attributes of vLLM's VllmConfig that config_from_vllm reads, nothing more."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=seqs),
        model_config=SimpleNamespace(max_model_len=max_len),
        cache_config=SimpleNamespace(block_size=block, enable_prefix_caching=prefix))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_the_package_imports_without_vllm_and_says_how_to_get_it() -> None:
    import atom_core.vllm as v

    with pytest.raises(ModuleNotFoundError, match=r"atom-core\[vllm\].*make vllm-venv"):
        _ = v.AtomScheduler


@pytest.mark.parametrize("prefix", [False, True])
def test_vllm_settings_map_onto_the_core(prefix: bool) -> None:
    cfg = config_from_vllm(settings(prefix=prefix), num_blocks=40)
    assert (cfg.lanes, cfg.kv_blocks, cfg.max_seq_len, cfg.block_size) == (4, 39, 256, 64)
    assert cfg.prefix_cache is prefix and cfg.preemption and cfg.blocks_per_table == 4
    assert cfg.prefill_chunk == 64  # a chunk never straddles two blocks
    one_block = config_from_vllm(settings(max_len=128, block=128), num_blocks=9)
    assert not one_block.preemption  # one block per table: nothing to preempt for


def test_the_proved_minimum_is_accepted_and_one_block_fewer_refused() -> None:
    need = min_kv_blocks(4, False, "dynamic", 4, True)  # the core's blocks, T + 1
    assert config_from_vllm(settings(), num_blocks=need + 1).kv_blocks == need
    with pytest.raises(ConfigError) as e:
        config_from_vllm(settings(), num_blocks=need)  # vLLM's null block leaves one too few
    msg = str(e.value)
    assert f"needs {need}" in msg and f"--num-gpu-blocks-override {need + 1}" in msg
    assert "rule '" in msg and "check-config" in msg


@pytest.mark.parametrize(("kw", "words"), [
    ({"block": 32}, "--block-size 32 is not a multiple of 64: .*give --block-size 64$"),
    ({"block": 96, "max_len": 384}, "give --block-size 64 or --block-size 128$"),
    ({"max_len": 200}, "--max-model-len 200 is not a multiple of --block-size 64.*"
                       "--max-model-len 192"),
    ({"seqs": 0}, "--max-num-seqs must be a positive integer"),
])
def test_refusals_name_vllms_flags(kw: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        config_from_vllm(settings(**kw), num_blocks=64)
