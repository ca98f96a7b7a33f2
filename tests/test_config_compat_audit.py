"""Configuration audit: bad settings refused before anything is allocated or compiled, with one
message naming the setting and the fix; good ones (a window covering the whole sequence, sizes
optimum-rbln 0.12.0 compiles) accepted.

optimum-rbln facts checked by `rbln_compile_errors` (0.12.0, `modeling_attention_utils`):
eager keeps kvcache_block_size == max_seq_len <= 32768 (ATOM); flash attention needs
kvcache_block_size == kvcache_partition_len in 1024..32768 with max_seq_len a multiple of at
least two partitions; a sliding window is at most 32768 - prefill_chunk_size; and
kvcache_num_blocks >= batch_size (eager) or min(max(T, batch_size) + 1, T * batch_size) (flash).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from atom_core.cli import main
from atom_core.config import Config, ConfigError, min_kv_blocks, rbln_compile_errors, rbln_fields

S, C = 256, 64


def run_json(capsys: Any, *argv: str) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# --------------------------------------------------------------------------- end tokens
def test_reference_generate_refuses_an_eos_outside_the_vocabulary() -> None:
    torch = pytest.importorskip("torch")  # noqa: F841
    from atom_core.runtime.reference import TorchReferenceRuntime

    cfg = Config(lanes=1, kv_blocks=1, max_seq_len=S, prefill_chunk=C)
    rt = TorchReferenceRuntime.tiny(cfg, vocab_size=128)
    with pytest.raises(ConfigError, match=r"end-of-sequence token id 128 outside the model's "
                                          r"vocabulary 0\.\.127"):
        rt.generate([1, 2, 3], 4, eos_token_id=128)
    with pytest.raises(ConfigError, match="-1"):
        rt.generate([1, 2, 3], 4, eos_token_id=-1)
    assert len(rt.generate([1, 2, 3], 4, eos_token_id=127)) >= 1  # in range: served


def test_serve_hf_refuses_end_tokens_the_model_cannot_emit(tmp_path: Path) -> None:
    """A model directory whose generation_config.json lists an end id at or past the model's
    vocab_size: refused when the server is built, before the weights are loaded."""
    pytest.importorskip("transformers")
    from atom_core.runtime import hf
    from atom_core.serve import runtimes
    from atom_core.serve.runtimes import ServeOptions
    from atom_core.serve.tokenizer import build_tiny_tokenizer

    d = build_tiny_tokenizer(tmp_path / "model")
    hf.HFRuntime.tiny_llama_model(0, vocab_size=320, max_position=S).save_pretrained(d)
    opts = ServeOptions(model=str(d), runtime="hf", overrides={"lanes": 1})
    cfg, rt, _tok = runtimes.hf_factory(opts)  # its own tokenizer: fine
    assert rt.vocab_size == 320 and cfg.lanes == 1
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 500]}))
    with pytest.raises(ConfigError, match=r"token id 500 outside the model's vocabulary "
                                          r"0\.\.319"):
        runtimes.hf_factory(opts)


# --------------------------------------------------------------------------- sliding window
@pytest.mark.parametrize("window", [S, 2 * S])
def test_a_window_covering_the_sequence_is_accepted_and_is_full_attention(window: int) -> None:
    """Decision: W >= max_seq_len is kept, not refused nor turned into None. transformers'
    sliding mask (q - W < k <= q) and the slot's last min(p, W) positions are then the whole
    prefix; optimum-rbln 0.12.0 compiles the model as 'hybrid' with that window (its only bound
    is W <= 32768 - prefill_chunk_size); the runtime still takes local block tables and must
    carry the model's window (`check_runtime`). Served, its tokens equal the plain model's."""
    pytest.importorskip("torch")
    from atom_core.batcher import AtomBatcher
    from atom_core.runtime.reference import TorchReferenceRuntime

    cfg = Config(lanes=2, kv_blocks=3, max_seq_len=S, prefill_chunk=C, sliding_window=window)
    assert cfg.sliding_window == window and cfg.consts().HYBRID
    assert rbln_compile_errors(cfg) == []
    rt = TorchReferenceRuntime.tiny(cfg, seed=5, sliding_window=window, layers=3,
                                    global_every=3)
    plain = TorchReferenceRuntime.tiny(attrs_evolve(cfg, sliding_window=None), seed=5, layers=3,
                                       global_every=3)
    b = AtomBatcher(cfg, rt)
    work = [([(7 * i + j) % 128 for j in range(n)], 6) for i, n in enumerate((150, 70, 200))]
    rids = [b.submit(p, n) for p, n in work]
    for _ in range(5000):
        if not b.busy():
            break
        b.step()
    for r, (p, n) in zip(rids, work, strict=True):
        assert b.requests[r].error is None
        assert b.requests[r].tokens == plain.generate(p, n)


def attrs_evolve(cfg: Config, **kw: Any) -> Config:
    import attrs

    return attrs.evolve(cfg, **kw)


def test_a_window_optimum_rbln_cannot_compile_is_named() -> None:
    cfg = Config(lanes=1, kv_blocks=2, max_seq_len=4096, prefill_chunk=128,
                 sliding_window=32_700)
    (msg,) = rbln_compile_errors(cfg)
    assert "sliding_window=32700" in msg and "32640" in msg
    assert rbln_compile_errors(attrs_evolve(cfg, sliding_window=32_640)) == []


# --------------------------------------------------------------------------- what RBLN compiles
@pytest.mark.parametrize("argv,setting", [
    # eager beyond ATOM's 32768
    (["--lanes", "2", "--kv-blocks", "2", "--max-seq-len", "65536"], "--max-seq-len 65536"),
    # paged tables are flash attention: partition (= block) 64 is below 1024
    (["--lanes", "2", "--kv-blocks", "8", "--max-seq-len", "256", "--block-size", "64",
      "--prefill-chunk", "64"], "kvcache_partition_len=64"),
    # preemption's minimum (T + 1 = 5 here) is below optimum-rbln's max(T, B) + 1 = 9
    (["--lanes", "8", "--kv-blocks", "6", "--max-seq-len", "8192", "--block-size", "2048",
      "--preemption"], "kvcache_num_blocks=9"),
])
def test_check_config_rbln_refuses_what_optimum_rbln_does_not_compile(
        capsys: Any, argv: list[str], setting: str) -> None:
    code, out = run_json(capsys, "check-config", *argv, "--rbln")
    assert code == 1 and out["safe"] is False
    assert "optimum-rbln 0.12.0 would not compile" in out["error"] and setting in out["error"]
    # without --rbln (flags may describe an artifact for another runtime): a note, not a refusal
    code, out = run_json(capsys, "check-config", *argv)
    assert any(setting in n for n in out["rbln_notes"])


def test_check_config_rbln_accepts_what_optimum_rbln_compiles(capsys: Any) -> None:
    for argv in (["--lanes", "4", "--kv-blocks", "5"],  # eager 4096
                 ["--lanes", "2", "--kv-blocks", "8", "--max-seq-len", "8192",
                  "--block-size", "2048"],  # flash, T = 4
                 ["--lanes", "2", "--kv-blocks", "5", "--max-seq-len", "8192",
                  "--block-size", "2048", "--preemption"]):
        code, out = run_json(capsys, "check-config", *argv, "--rbln")
        assert code == 0 and out["safe"] and "rbln_notes" not in out, out


def test_check_config_refuses_an_artifact_optimum_rbln_would_not_have_compiled(
        tmp_path: Path, capsys: Any) -> None:
    """An rbln_config.json that records attn_impl is an optimum-rbln artifact: a flag that takes
    it outside what it compiles (here a paged block size under eager attention) is refused."""
    path = tmp_path / "rbln_config.json"
    path.write_text(json.dumps({"batch_size": 2, "max_seq_len": 4096, "kvcache_block_size": 4096,
                                "kvcache_num_blocks": 2, "prefill_chunk_size": 128,
                                "attn_impl": "eager"}))
    assert main(["check-config", "--rbln-config", str(path)]) == 0
    code, out = run_json(capsys, "check-config", "--rbln-config", str(path), "--block-size",
                         "1024", "--kv-blocks", "8")
    # (in the command line's words: the flag that set it)
    assert code == 1 and "attn_impl='eager'" in out["error"] and "--block-size 1024" in out["error"]


# --------------------------------------------------------------------------- misspelt keys
@pytest.mark.parametrize("typo,right", [("max_seq_length", "max_seq_len"),
                                        ("kv_cache_block_size", "kvcache_block_size"),
                                        ("prefill_chunk", "prefill_chunk_size"),
                                        ("enable_prefix_cache", "enable_prefix_caching")])
def test_a_misspelt_rbln_key_is_refused_not_ignored(typo: str, right: str) -> None:
    base = {"batch_size": 2, "kvcache_num_blocks": 8, "max_seq_len": 1024}
    data = {k: v for k, v in base.items() if k != right}
    data[typo] = 512 if "prefix" not in typo else True
    with pytest.raises(ConfigError, match=f"unknown setting '{typo}': did you mean '{right}'"):
        rbln_fields(data)


def test_keys_optimum_rbln_writes_are_not_taken_for_typos() -> None:
    data = {"batch_size": 2, "kvcache_num_blocks": 8, "max_seq_len": 1024,
            "image_prefill_chunk_size": 128, "sliding_window_layers": [0], "patch_size": 14,
            "dec_max_seq_len": 64, "max_num_batched_tokens": 512, "tensor_parallel_size": 4}
    assert rbln_fields(data)["max_seq_len"] == 1024
    # the right key given as well: the look-alike is someone else's, not a lost setting
    assert rbln_fields({**data, "max_seq_length": 5})["max_seq_len"] == 1024


def test_from_rbln_refuses_an_override_that_is_no_config_field() -> None:
    art = {"batch_size": 2, "kvcache_num_blocks": 8, "max_seq_len": 1024}
    with pytest.raises(ConfigError, match="'max_seq_length' is not a Config field; did you "
                                          "mean 'max_seq_len'"):
        Config.from_rbln(art, max_seq_length=512)
    assert Config.from_rbln(art, max_seq_len=512).max_seq_len == 512


# --------------------------------------------------------------------------- shown sound
@pytest.mark.parametrize("field,value", [
    ("max_seq_len", 4096.0), ("max_seq_len", True), ("max_seq_len", "4096"), ("max_seq_len", 0),
    ("block_size", -64), ("prefill_chunk", 96), ("lanes", 0), ("kv_blocks", 2.0),
    ("host_cache_blocks", -1), ("host_cache_blocks", 1.0), ("sliding_window", 0),
    ("sliding_window", 16.0), ("prefix_cache", "true"), ("scratch", None),
])
def test_bad_types_and_sizes_are_config_errors_naming_the_field(field: str, value: Any) -> None:
    kw: dict[str, Any] = {"lanes": 2, "kv_blocks": 8, field: value}
    with pytest.raises(ConfigError, match=field):
        Config(**kw)


def test_block_size_must_divide_max_seq_len_and_the_chunk_a_paged_block() -> None:
    with pytest.raises(ConfigError, match="not a multiple of block_size=1536"):
        Config(lanes=1, kv_blocks=4, max_seq_len=4096, block_size=1536)
    with pytest.raises(ConfigError, match="chunk"):
        Config(lanes=1, kv_blocks=4, max_seq_len=256, block_size=64, prefill_chunk=128)
    need = min_kv_blocks(1, False, "dynamic", 4)
    assert Config(lanes=1, kv_blocks=need, max_seq_len=256, block_size=64,
                  prefill_chunk=64).blocks_per_table == 4
