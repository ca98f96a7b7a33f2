"""Configuration edge audit: settings that construct but cannot work as asked (a prefix cache no
prompt can ever hit), CLI commands that disagree on the same artifact (min-blocks against
check-config --rbln), a model refused although every sequence it serves is exact (Qwen2 sliding
layers whose window covers max_seq_len), and an rbln_config.json read twice (a pipe is readable
once).

Served checks use the real things: tiny transformers checkpoints saved with save_pretrained,
served through `HFRuntime.from_pretrained` and compared token for token with transformers' own
greedy generate() (`tests.test_runtime_hf_audit.serve`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import attrs
import pytest

from atom_core.cli import main
from atom_core.config import Config, ConfigError, min_kv_blocks


def run_json(capsys: Any, *argv: str) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# --------------------------------------------------------------------------- dead prefix cache
@pytest.mark.parametrize("max_seq_len,chunk", [(128, 128), (129, 128), (192, 192), (193, 192)])
def test_a_prefix_cache_that_can_never_hit_is_refused(max_seq_len: int, chunk: int) -> None:
    """A hit reuses whole chunks and leaves a token to compute, and a prompt holds at most
    max_seq_len - 1 tokens: with prefill_chunk >= max_seq_len - 1 no prompt can ever hit, so
    the prefix cache only costs a block (a host tier beside it, its slots). Decision: refuse
    (turning it off loses nothing), naming why and the settings that make it useful."""
    with pytest.raises(ConfigError, match=rf"prefix_cache=True can never hit with "
                                          rf"prefill_chunk={chunk} and max_seq_len="
                                          rf"{max_seq_len}.*prefix_cache=False.*max_seq_len >= "
                                          rf"{chunk + 2}"):
        Config(lanes=1, kv_blocks=3, max_seq_len=max_seq_len, prefill_chunk=chunk,
               prefix_cache=True)
    # the same sizes without the prefix cache are fine
    Config(lanes=1, kv_blocks=3, max_seq_len=max_seq_len, prefill_chunk=chunk)


def test_check_config_refuses_a_prefix_cache_that_can_never_hit(capsys: Any) -> None:
    code, out = run_json(capsys, "check-config", "--lanes", "2", "--kv-blocks", "4",
                         "--prefix-cache", "--max-seq-len", "128", "--prefill-chunk", "128")
    assert code == 1 and out["safe"] is False and "can never hit" in out["error"]
    assert "use --prefill-chunk 64 or less" in out["error"]  # (the flag, as given)


def test_a_prefix_cache_one_token_past_the_bound_hits_exactly(tmp_path: Path) -> None:
    """max_seq_len = prefill_chunk + 2 is accepted and really hits: a prompt of chunk + 1 tokens
    reuses the cached chunk, and the tokens equal generate()'s (so the bound is exact)."""
    pytest.importorskip("transformers")
    from atom_core.runtime.hf import HFRuntime
    from tests.test_runtime_hf import F64
    from tests.test_runtime_hf_audit import serve

    chunk, seq = 128, 130
    cfg = Config(lanes=1, kv_blocks=min_kv_blocks(1, True, "dynamic"), max_seq_len=seq,
                 prefill_chunk=chunk, prefix_cache=True)
    d = tmp_path / "llama"
    HFRuntime.tiny_llama_model(0, max_position=seq, dtype=F64).save_pretrained(d)
    shared = [(5 * i + 3) % 128 for i in range(chunk)]
    b = serve(cfg, d, [(shared + [7], 4), (shared + [9], 4)])
    assert b.stats.prefix_hit_tokens == chunk


# --------------------------------------------------------------------------- min-blocks --rbln
# (where the spec's rule decides, lanes * T is above check-config's stuck-run search: a count
# below it is reported from the rule alone)
AGREE = [
    # eager, the spec's minimum is optimum-rbln's batch_size
    ["--lanes", "2", "--max-seq-len", "4096"],
    # eager with the prefix cache: the spec asks more than optimum-rbln
    ["--lanes", "9", "--max-seq-len", "4096", "--prefix-cache"],
    # flash attention, T = 2: the spec's lanes * T is above optimum-rbln's max(T, B) + 1
    ["--lanes", "5", "--max-seq-len", "4096", "--block-size", "2048"],
    # preemption: the spec's T + 1 = 5 is below optimum-rbln's max(T, B) + 1 = 9
    ["--lanes", "8", "--max-seq-len", "8192", "--block-size", "2048", "--preemption"],
    # one lane with preemption: T (4) for both
    ["--lanes", "1", "--max-seq-len", "8192", "--block-size", "2048", "--preemption"],
]


@pytest.mark.parametrize("argv", AGREE)
def test_min_blocks_rbln_is_what_check_config_rbln_accepts(capsys: Any, argv: list[str]) -> None:
    """The count `min-blocks --rbln` gives is the least `check-config --rbln` calls safe: before,
    min-blocks knew only the spec's rule, so for preemption it answered 5 blocks that
    check-config --rbln then refused (optimum-rbln compiles no fewer than 9)."""
    code, out = run_json(capsys, "min-blocks", *argv, "--rbln")
    assert code == 0, out
    least = out["min_kv_blocks"]
    code, ok = run_json(capsys, "check-config", *argv, "--rbln", "--kv-blocks", str(least))
    assert code == 0 and ok["safe"] is True, ok
    code, below = run_json(capsys, "check-config", *argv, "--rbln", "--kv-blocks",
                           str(least - 1))
    assert code == 1 and below["safe"] is False, below


def test_min_blocks_rbln_raises_the_minimum_and_says_why(capsys: Any) -> None:
    argv = ["min-blocks", "--lanes", "8", "--max-seq-len", "8192", "--block-size", "2048",
            "--preemption"]
    code, out = run_json(capsys, *argv, "--rbln")
    assert code == 0 and out["min_kv_blocks"] == 9 and out["spec_min_kv_blocks"] == 5
    assert main([*argv, "--rbln"]) == 0
    assert "optimum-rbln 0.12.0 compiles no fewer than 9" in capsys.readouterr().out
    # without --rbln (the flags may describe another runtime): the spec's count and a note
    code, out = run_json(capsys, *argv)
    assert code == 0 and out["min_kv_blocks"] == 5
    assert any("kvcache_num_blocks=9" in n for n in out["rbln_notes"])


@pytest.mark.parametrize("argv,setting", [
    (["--lanes", "2", "--max-seq-len", "65536"], "--max-seq-len 65536"),
    (["--lanes", "2", "--max-seq-len", "256", "--block-size", "64", "--prefill-chunk", "64"],
     "kvcache_partition_len=64"),
])
def test_min_blocks_rbln_refuses_what_check_config_rbln_refuses(
        capsys: Any, argv: list[str], setting: str) -> None:
    code, cc = run_json(capsys, "check-config", *argv, "--kv-blocks", "64", "--rbln")
    assert code == 1 and setting in cc["error"]
    code, mb = run_json(capsys, "min-blocks", *argv, "--rbln")
    assert code == 2 and mb["ok"] is False and mb["error"] == cc["error"]


def test_min_blocks_is_strict_for_an_artifact_that_records_attn_impl(
        capsys: Any, tmp_path: Path) -> None:
    """As check-config: a compiled decoder's rbln_config.json records attn_impl, so its sizes
    are optimum-rbln's and the checks refuse without --rbln."""
    f = tmp_path / "rbln_config.json"
    f.write_text(json.dumps({"batch_size": 8, "kvcache_num_blocks": 9, "max_seq_len": 8192,
                             "kvcache_block_size": 2048, "kvcache_partition_len": 2048,
                             "attn_impl": "flash_attn", "prefill_chunk_size": 128}))
    code, out = run_json(capsys, "min-blocks", "--rbln-config", str(f), "--preemption")
    assert code == 0 and out["min_kv_blocks"] == 9


# --------------------------------------------------------------------------- one read of the file
def _pipe(text: str) -> str:
    """A path readable once, as `--rbln-config <(cat rbln_config.json)` gives: the read end of a
    pipe whose writer has closed (a second open reads nothing)."""
    r, w = os.pipe()
    os.write(w, text.encode())
    os.close(w)
    return f"/dev/fd/{r}"


RBLN = {"batch_size": 2, "kvcache_num_blocks": 4, "max_seq_len": 4096,
        "kvcache_block_size": 4096, "prefill_chunk_size": 128, "attn_impl": "eager"}


@pytest.mark.parametrize("command", ["check-config", "min-blocks"])
def test_rbln_config_is_read_once(capsys: Any, command: str) -> None:
    """Before, check-config read the file twice (`rbln_fields`, then `rbln_settings`): from a
    pipe the second read was empty, and it failed with '/dev/fd/N is not valid JSON'."""
    path = _pipe(json.dumps(RBLN))
    try:
        code, out = run_json(capsys, command, "--rbln-config", path)
    finally:
        os.close(int(path.rsplit("/", 1)[1]))
    assert code == 0, out
    assert out["lanes"] == 2 and out.get("safe", True) is True


def test_rbln_config_errors_still_name_the_file(capsys: Any, tmp_path: Path) -> None:
    f = tmp_path / "rbln_config.json"
    f.write_text("{not json")
    code, out = run_json(capsys, "check-config", "--rbln-config", str(f))
    assert code == 2 and out["error"].startswith(f"{f} is not valid JSON")
    f.write_text(json.dumps({"batch_size": 2, "kvcache_num_blocks": 4, "max_seq_length": 4096}))
    code, out = run_json(capsys, "check-config", "--rbln-config", str(f))
    assert code == 2 and out["error"].startswith(f"{f}: unknown setting 'max_seq_length'")


# --------------------------------------------------------------------------- Qwen2 sliding layers
QWEN_WINDOWS = {"qwen2-sliding-window-S": 256, "qwen2-sliding-window-above-S": 300}


@pytest.fixture(scope="module")
def families_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("edge-families")


@pytest.mark.parametrize("name", list(QWEN_WINDOWS))
def test_qwen2_sliding_layers_covering_max_seq_len_are_served_exactly(
        families_root: Path, name: str) -> None:
    """Qwen2 with sliding layers (max_window_layers=1: layer 1 slides) whose window is at least
    max_seq_len: transformers' sliding mask hides no key of any sequence the server accepts, so
    they are full attention. Before, refused for their layer type alone. Served on every path
    (prefix hits, preemption, a generation to max_seq_len), equal to generate()."""
    pytest.importorskip("transformers")
    from tests.test_runtime_hf_audit import serve
    from tests.test_runtime_hf_families_audit import (
        S,
        check_paths,
        config,
        paths_work,
        qwen2,
        save,
    )

    model = qwen2(use_sliding_window=True, sliding_window=QWEN_WINDOWS[name],
                  max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert QWEN_WINDOWS[name] >= S
    b = serve(config(), save(model, families_root, name), paths_work(to_end=True))
    check_paths(b)


def test_qwen2_sliding_layers_narrower_than_max_seq_len_are_refused(families_root: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import Qwen2Config

    from atom_core.runtime.hf import HFRuntime, UnsupportedModelError
    from tests.test_runtime_hf import F64
    from tests.test_runtime_hf_families_audit import COMMON, S, config, config_only

    cfg = Qwen2Config(**{**COMMON, "use_sliding_window": True, "sliding_window": S - 1,
                         "max_window_layers": 1})
    d = config_only(families_root, "qwen2-window-S-1", cfg)
    with pytest.raises(UnsupportedModelError, match=rf"sliding_window={S - 1} < max_seq_len={S}"
                                                    rf".*use max_seq_len <= {S - 1}"):
        HFRuntime.from_pretrained(d, config(), dtype=F64)


# --------------------------------------------------------------------------- RBLN artifact files
@pytest.mark.parametrize("text,why", [("{\"max_seq_len\": 4096,", "is not valid JSON"),
                                      ("[4096]", "must hold a JSON object, got list")])
def test_a_broken_rbln_config_in_an_artifact_is_named(tmp_path: Path, text: str,
                                                      why: str) -> None:
    """Loading a compiled artifact whose rbln_config.json is truncated or not an object: before,
    a bare JSONDecodeError (or AttributeError on a list) with no file named."""
    from atom_core.runtime.rbln import RblnArtifactError, read_artifact

    f = tmp_path / "rbln_config.json"
    f.write_text(text)
    with pytest.raises(RblnArtifactError, match=rf"{f} {why}"):
        read_artifact(tmp_path)
    # a multimodal artifact's nested language model file, too
    sub = tmp_path / "language_model"
    sub.mkdir()
    f.write_text(json.dumps({"language_model": {"max_seq_len": 4096}}))
    (sub / "rbln_config.json").write_text(text)
    with pytest.raises(RblnArtifactError, match=rf"{sub / 'rbln_config.json'} {why}"):
        read_artifact(tmp_path)


# --------------------------------------------------------------------------- end tokens
def test_serve_ends_replies_where_generate_ends_without_a_generation_config(
        tmp_path: Path) -> None:
    """A checkpoint with no generation_config.json whose config.json lists two end ids:
    transformers' generate() stops at either (it derives its generation config from the model
    config); the tokenizer reads generation_config.json only, so before, the server ended
    replies at the tokenizer's eos alone and ran past the model's second end id."""
    pytest.importorskip("transformers")
    import torch

    from atom_core.runtime import hf
    from atom_core.serve import runtimes
    from atom_core.serve.runtimes import ServeOptions
    from atom_core.serve.tokenizer import HFTokenizer, build_tiny_tokenizer, end_ids

    d = build_tiny_tokenizer(tmp_path / "model")
    eos = HFTokenizer(d).eos_token_id
    model = hf.HFRuntime.tiny_llama_model(0, vocab_size=320, max_position=256)
    prompt = torch.tensor([[11, 12, 13, 14]])
    with torch.inference_mode():
        free = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
    other = next(t for t in free[2:] if t != eos and t not in free[:2])  # a later greedy token
    model.config.eos_token_id = [eos, other]
    model.generation_config.eos_token_id = None  # saved, it would be generation_config.json
    model.save_pretrained(d)
    (d / "generation_config.json").unlink(missing_ok=True)

    cfg, rt, tok = runtimes.hf_factory(ServeOptions(model=str(d), runtime="hf",
                                                 overrides={"lanes": 1}))
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
    with torch.inference_mode():  # what generate() does with the checkpoint's own settings
        out = loaded.generate(prompt, attention_mask=torch.ones_like(prompt),
                              max_new_tokens=6, do_sample=False, pad_token_id=0)
    stopped = out[0, 4:].tolist()
    assert stopped[-1] == other and len(stopped) < len(free)
    assert other in end_ids(tok)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_tokenizer_ends_where_generate_ends_without_a_generation_config(
        tmp_path: Path, family: str) -> None:
    """A model directory (an RBLN artifact, a checkpoint served by the reference runtime)
    with no generation_config.json: the tokenizer's end ids are config.json's, as the
    generation config transformers derives from the model config says (a multimodal config
    keeps them in its text config). Before, the tokenizer knew only its own eos token and a
    reply ran past the model's second end id."""
    transformers = pytest.importorskip("transformers")
    from atom_core.serve.tokenizer import HFTokenizer, build_tiny_tokenizer, end_ids, id_list

    d = build_tiny_tokenizer(tmp_path / "model")
    eos = HFTokenizer(d).eos_token_id
    ends = [eos, 300]
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=320, eos_token_id=ends)
    else:
        cfg = transformers.Gemma3Config(text_config={"vocab_size": 320, "eos_token_id": ends})
    cfg.save_pretrained(d)
    (d / "generation_config.json").unlink(missing_ok=True)
    derived = transformers.GenerationConfig.from_model_config(
        transformers.AutoConfig.from_pretrained(d, local_files_only=True))
    assert set(id_list(derived.eos_token_id)) == set(ends)  # transformers' own reading
    assert set(end_ids(HFTokenizer(d))) == set(ends)


# --------------------------------------------------------------------------- max_seq_len
def test_from_rbln_does_not_invent_max_seq_len() -> None:
    """vllm-rbln style settings with a block size but no max_model_len: before, Config's 4096
    default silently made T = 4096 / block_size blocks per table and the longest prompt 4095."""
    flags = {"max_num_seqs": 2, "num_gpu_blocks_override": 16, "block_size": 1024}
    with pytest.raises(ConfigError, match=r"has no max_seq_len \(or max_model_len\): give it "
                                          r"in the file or as max_seq_len="):
        Config.from_rbln(flags)
    cfg = Config.from_rbln({**flags, "max_model_len": 2048})
    assert (cfg.max_seq_len, cfg.blocks_per_table) == (2048, 2)
    assert Config.from_rbln(flags, max_seq_len=8192).blocks_per_table == 8


# --------------------------------------------------------------------------- min-blocks' failures
@pytest.mark.parametrize("argv", [
    ["--lanes", "2", "--max-seq-len", "1024", "--block-size", "384"],   # Config refuses
    ["--rbln-config", "/nonexistent/rbln_config.json"],                 # the file
    ["--lanes", "2", "--max-seq-len", "65536", "--rbln"],               # optimum-rbln refuses
])
def test_min_blocks_fails_with_the_cli_failure_object(capsys: Any, argv: list[str]) -> None:
    """min-blocks has no verdict: a failure is `{"ok": false, "error"}` (README's contract for
    every command but check-config), not check-config's `"safe": false` (before, a refused
    configuration said "safe" and a bad file neither)."""
    code, out = run_json(capsys, "min-blocks", *argv)
    assert code == 2 and out["ok"] is False and out["error"] and "safe" not in out


# --------------------------------------------------------------------------- what RBLN serves
@pytest.mark.parametrize("argv,setting", [
    (["--prefix-cache", "--host-cache-blocks", "4"], "host_cache_blocks: host KV transfers"),
    (["--prefix-cache"], "prefix_cache: a hybrid model's hits"),
])
def test_check_config_rbln_refuses_what_the_rbln_runtime_does_not_serve(
        capsys: Any, tmp_path: Path, argv: list[str], setting: str) -> None:
    """optimum-rbln compiles these sizes, but the batcher refuses them over `RblnRuntime`
    (`check_runtime`: host KV transfers are off, and a hybrid hit needs a local-slot host copy
    the binding lacks): before, check-config --rbln said SAFE for what `serve --runtime rbln`
    then refused. The second case is a hybrid artifact (window 64)."""
    pytest.importorskip("torch")
    from atom_core.batcher import AtomBatcher
    from atom_core.runtime.rbln import RblnRuntime

    hybrid = setting.startswith("prefix_cache")
    f = tmp_path / "rbln_config.json"
    f.write_text(json.dumps({"batch_size": 2, "kvcache_num_blocks": 4, "max_seq_len": 4096,
                             "prefill_chunk_size": 128, "attn_impl": "eager",
                             **({"cache_impl": "hybrid", "sliding_window": 64} if hybrid
                                else {})}))
    code, out = run_json(capsys, "check-config", "--rbln-config", str(f), *argv)
    assert code == 1 and out["safe"] is False
    assert "atom-core's RBLN runtime would not serve it" in out["error"]
    assert setting in out["error"]
    code, out = run_json(capsys, "min-blocks", "--rbln-config", str(f), *argv)
    assert code == 2 and setting in out["error"]

    # the runtime agrees: graphs already loaded (never called here) over the same sizes
    cfg = Config(lanes=2, kv_blocks=4, max_seq_len=4096, prefix_cache=True,
                 host_cache_blocks=0 if hybrid else 4, sliding_window=64 if hybrid else None)
    rt = RblnRuntime(prefill=object(), decoders={2: object()}, num_blocks=4, block_size=4096,
                     max_seq_len=4096, prefill_chunk=128, vocab_size=128, hybrid=hybrid,
                     sliding_window=64 if hybrid else None)
    with pytest.raises(ValueError, match=re.escape(setting)):  # (the same words)
        AtomBatcher(cfg, rt)
    # and without the refused setting both accept it
    argv = [a for a in argv if a not in ("--host-cache-blocks", "4")] if not hybrid else []
    code, out = run_json(capsys, "check-config", "--rbln-config", str(f), *argv)
    assert code == 0 and out["safe"] is True
    AtomBatcher(attrs.evolve(cfg, host_cache_blocks=0, prefix_cache=not hybrid), rt)
