"""Issue 49, round three, items 5 and 7: one validated options layer for every command, one
total way of reading rbln_config.json, and errors that say what to give.

Every bad input here ends in exit 2 (a usage error) with one line on stderr naming the option
(or the file's key) and what to give, and no traceback; options are checked before torch or
transformers is imported; a configuration's message names the flag of the interface used."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from atom_core import cli
from atom_core import options as opt
from atom_core.config import Config, ConfigError, flag_vocabulary, from_rbln, read_rbln

ROOT = Path(__file__).resolve().parent.parent
GOOD = {"batch_size": 2, "kvcache_num_blocks": 4, "max_seq_len": 256, "kvcache_block_size": 256}


def _usage(capsys: Any, argv: list[str]) -> str:
    """stderr of a usage error (exit 2), checked to be one line without a traceback."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


def _file(tmp_path: Path, data: Any, name: str = "rbln_config.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


# ----------------------------------------------------------------------- rbln_config.json keys
@pytest.mark.parametrize("key,value,says", [
    ("kvcache_block_size", 0, "kvcache_block_size=0 must be a positive integer"),
    ("kvcache_block_size", True, "kvcache_block_size=True must be a positive integer"),
    ("kvcache_block_size", 64.0, "kvcache_block_size=64.0 must be a positive integer"),
    ("kvcache_block_size", "64", "kvcache_block_size='64' must be a positive integer"),
    ("batch_size", {"n": 2}, "batch_size={'n': 2} must be a positive integer"),
    ("batch_size", [2] * 10_000, "batch_size=[2, 2, 2, 2, 2, 2, ...] must be"),
    ("max_seq_len", -256, "max_seq_len=-256 must be a positive integer"),
    ("prefill_chunk_size", 0, "prefill_chunk_size=0 must be a positive integer"),
    ("sliding_window", 0, "sliding_window=0 must be a positive integer"),
    ("enable_prefix_caching", 1, "enable_prefix_caching=1 must be true or false"),
    ("kvcache_num_blocks", -1, "kvcache_num_blocks=-1 must be a non-negative integer"),
    ("kvcache_partition_len", 0, "kvcache_partition_len=0 must be a positive integer"),
    ("attn_impl", ["eager"], "attn_impl=['eager'] must be a string"),
    ("cache_impl", "paged", "cache_impl='paged' is not one optimum-rbln writes"),
    ("max_seq_len", None, "has no max_seq_len (or max_model_len): give it in the file or as "
                          "--max-seq-len"),
    # (Config's int16 rule, the value named with the key that set it)
    ("batch_size", 10**40, f"={10**40} (batch_size in "),
])
@pytest.mark.parametrize("command", ["check-config", "min-blocks", "serve"])
def test_a_bad_key_is_named_with_what_to_give(capsys: Any, tmp_path: Path, command: str,
                                              key: str, value: Any, says: str) -> None:
    """kvcache_block_size=0 was a ZeroDivisionError traceback in all three; a wrong type a
    TypeError; null max_seq_len an invented 4096."""
    path = _file(tmp_path, {**GOOD, key: value})
    extra = ["--insecure-no-auth"] if command == "serve" else []
    try:
        code = cli.main([command, "--rbln-config", path, *extra])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    # (a value Config refuses is check-config's unsafe verdict, exit 1; the rest are usage)
    assert code in ((1, 2) if command == "check-config" else (2,)), err
    assert says in err, err
    assert len(err) < 1000  # a huge value is quoted cut short


def test_a_file_without_max_seq_len_is_refused_everywhere(capsys: Any, tmp_path: Path) -> None:
    """Before, check-config, min-blocks and serve took Config's 4096 (from_rbln required it)."""
    path = _file(tmp_path, {"batch_size": 2, "kvcache_num_blocks": 4})
    for argv in (["check-config", "--rbln-config", path],
                 ["min-blocks", "--rbln-config", path],
                 ["serve", "--rbln-config", path, "--insecure-no-auth"]):
        err = _usage(capsys, argv)
        assert "has no max_seq_len (or max_model_len): give it in the file or as --max-seq-len" \
            in err
    # given on the command line, it is taken
    assert cli.main(["check-config", "--rbln-config", path, "--max-seq-len", "256"]) == 0
    with pytest.raises(ConfigError, match="give it in the file or as max_seq_len="):
        from_rbln(path)


@pytest.mark.parametrize("text,says", [
    ("[" * 100_000 + "]" * 100_000, "nests its JSON too deeply to read"),
    ('{"batch_size": 1' + "0" * 5000 + "}", "holds a number of more than 4300 digits"),
    ('{"batch_size": NaN}', "batch_size=nan must be a positive integer"),
    ("\xff", "not valid JSON"),
])
def test_a_file_that_is_not_an_rbln_config_is_one_line(capsys: Any, tmp_path: Path, text: str,
                                                       says: str) -> None:
    """A file nested 100,000 levels deep was a RecursionError traceback."""
    path = _file(tmp_path, text)
    for command in ("check-config", "min-blocks"):
        assert says in _usage(capsys, [command, "--rbln-config", path])


def test_an_oversized_file_is_not_read_whole(tmp_path: Path, monkeypatch: Any) -> None:
    from atom_core import rbln_config

    monkeypatch.setattr(rbln_config, "MAX_RBLN_BYTES", 64)
    path = _file(tmp_path, {**GOOD, "model_id": "x" * 100})
    with pytest.raises(ConfigError, match="larger than"):
        read_rbln(path)


def test_the_settings_are_read_once_and_checked_on_reading(tmp_path: Path) -> None:
    path = _file(tmp_path, {**GOOD, "kvcache_block_size": 64, "sliding_window": 32,
                            "cache_impl": "hybrid"})
    settings = read_rbln(path)
    assert read_rbln(settings) is settings  # (a reader given settings does not read again)
    assert settings.fields["block_size"] == 64 and settings.keys["block_size"] == \
        "kvcache_block_size"
    assert settings.origins(given={"lanes"}) == {
        f: f"{k} in {path}" for f, k in settings.keys.items() if f != "lanes"}


# ----------------------------------------------------------------------- numeric options
def _commands() -> dict[str, argparse.ArgumentParser]:
    ap = cli.build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _numeric() -> list[tuple[str, str]]:
    """(command, flag) of every option that takes a number."""
    out = []
    for name, parser in _commands().items():
        for a in parser._actions:
            if a.option_strings and getattr(a.type, "__module__", None) == opt.__name__:
                out.append((name, a.option_strings[-1]))
    return out


def test_every_numeric_option_goes_through_the_options_layer() -> None:
    """No command takes a raw int or float: each type refuses nan, inf, negatives and huge
    values itself (with int, `--block-size 0` reached a division; with float, nan a timer)."""
    raw = [(name, a.option_strings[-1]) for name, parser in _commands().items()
           for a in parser._actions if a.type in (int, float)]
    assert raw == []
    assert len(_numeric()) > 40


@pytest.mark.parametrize("command,flag", _numeric())
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e999", "9" * 30, "x"])
def test_every_numeric_option_refuses_what_means_nothing(capsys: Any, command: str, flag: str,
                                                        value: str) -> None:
    err = _usage(capsys, [command, flag, value])
    assert f"argument {flag}" in err or f"/{flag}" in err, err
    assert ("expected " in err or "must be " in err), err


@pytest.mark.parametrize("argv,says", [
    (["serve", "--block-size", "0"], "argument --block-size: must be an integer in 1..2147483648"),
    (["serve", "--lanes", "40000"], "argument --lanes: must be an integer in 1..32768 (rule "
                                    "'int16-ids'"),
    (["serve", "--request-timeout", "nan"],
     "argument --request-timeout: must be seconds > 0 (0: never), finite"),
    (["serve", "--request-timeout", "-1"], "argument --request-timeout: must be seconds > 0"),
    (["serve", "--drain-timeout", "nan"],
     "argument --drain-timeout: must be seconds > 0 (0: abort them at once)"),
    (["serve", "--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["pd-decode", "--prefetch", "-1"],
     "argument --prefetch: must be an integer in 0..32768 (0: ask for KV only once a lane"),
    (["pd-cluster", "--prefill", "-1"], "argument --prefill: must be an integer in 0..256"),
    (["pd-cluster", "--kill", "decode:-1@2"], "argument --kill: expected prefill:I@N"),
    (["simulate", "--seeds=-3..1"], "argument --seeds: seeds must be in 0.."),
    (["simulate", "--minutes", "inf"], "argument --minutes: must be minutes > 0"),
    (["verify", "-j", "100000"], "argument -j/--jobs: must be an integer in 1..1024"),
    (["check-config", "--host-cache-blocks", "-1"],
     "argument --host-cache-blocks: must be an integer in 0..32768 (0: none;"),
])
def test_the_issues_values_are_refused_up_front(capsys: Any, argv: list[str], says: str) -> None:
    """`serve --request-timeout nan` made every request a 500, -1 every one a 504,
    `--drain-timeout nan` crashed the shutdown, `--block-size 0` divided by zero."""
    assert says in _usage(capsys, argv)


def test_zero_keeps_its_meaning_where_it_has_one() -> None:
    args = cli.build_parser().parse_args(["serve", "--request-timeout", "0", "--drain-timeout",
                                          "0", "--port", "0", "--max-queue", "0"])
    assert (args.request_timeout, args.drain_timeout, args.port, args.max_queue) == (0, 0, 0, 0)


@pytest.mark.parametrize("argv,key", [
    (["check-config", "--lanes", "x", "--json"], "safe"),
    (["min-blocks", "--lanes", "0", "--json"], "ok"),
    (["pd-decode", "--prefetch", "-1", "--json"], "ok"),
])
def test_a_usage_error_with_json_is_the_json_failure_object(capsys: Any, argv: list[str],
                                                           key: str) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out[key] is False and out["error"].startswith("argument ")
    assert out["error"] in cap.err


# --------------------------------------------------------------------- abbreviations, version
def test_no_parser_takes_abbreviations() -> None:
    assert cli.build_parser().allow_abbrev is False
    assert all(p.allow_abbrev is False for p in _commands().values())


@pytest.mark.parametrize("argv", [["serve", "--max-se", "512"],
                                  ["check-config", "--lanes", "2", "--kv-blo", "4"],
                                  ["demo", "--req", "3"]])
def test_an_abbreviated_flag_is_refused_with_the_full_one(capsys: Any, argv: list[str]) -> None:
    """`--max-se 512` was silently `--max-seq-len 512`."""
    err = _usage(capsys, argv)
    assert f"unrecognized arguments: {argv[-2]}" in err and "did you mean --" in err
    assert err.startswith(f"atom-core {argv[0]}: error:")  # (the command's own flags)


def test_version_is_the_installed_packages(capsys: Any) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"atom-core {version('atom-core')}"


# ----------------------------------------------------------------- the words of each interface
def test_a_capacity_error_names_the_interfaces_words(capsys: Any, tmp_path: Path) -> None:
    """The hint said "compile the artifact with kv_blocks >= 16 ... or turn preemption on"
    whatever the interface: now flags on the command line, field names from Python, file keys
    for an artifact."""
    kw = dict(lanes=4, kv_blocks=6, max_seq_len=256, block_size=64, prefill_chunk=64)
    with pytest.raises(ConfigError) as e:
        Config(**kw)  # type: ignore[arg-type]
    python = str(e.value)
    assert "kv_blocks=6 is too few for lanes=4" in python
    assert "compile the artifact with kv_blocks >= 16" in python
    assert "turn preemption on (preemption=True:" in python and "which needs 5" in python
    cli_words = e.value.in_terms(flag_vocabulary(["lanes", "kv_blocks", "preemption"]))
    assert "--kv-blocks 6 is too few for --lanes 4" in cli_words
    assert "give --kv-blocks 16 or more" in cli_words and "kv_blocks >= 16" not in cli_words
    assert "serve with --lanes 1 or less" in cli_words
    assert "turn preemption on (--preemption:" in cli_words

    err = _usage(capsys, ["serve", "--insecure-no-auth", *sum(
        ([f"--{k.replace('_', '-')}", str(v)] for k, v in kw.items()), [])])
    assert "Fix: give --kv-blocks 16 or more" in err and "--preemption" in err
    assert "kv_blocks=" not in err and "kv_blocks >=" not in err.split("rule")[0]

    path = _file(tmp_path, {"batch_size": 4, "kvcache_num_blocks": 6, "max_seq_len": 256,
                            "kvcache_block_size": 64, "prefill_chunk_size": 64})
    with pytest.raises(ConfigError, match="kvcache_num_blocks=6 is too few for batch_size=4.*"
                                          "compile the artifact with kvcache_num_blocks >= 16"):
        Config.from_rbln(path)
    # an override is named as the Python API names it
    with pytest.raises(ConfigError, match="kv_blocks=6 is too few for batch_size=4"):
        Config.from_rbln(path, kv_blocks=6)


def test_a_default_block_size_says_where_it_comes_from(capsys: Any) -> None:
    """`serve --max-seq-len 300` was refused as "not a multiple of block_size=64" though no
    block size was given: the tiny model's default."""
    err = _usage(capsys, ["serve", "--insecure-no-auth", "--max-seq-len", "300"])
    assert "--max-seq-len 300 is not a multiple of block_size=64 (the built-in tiny model's " \
           "default; --block-size sets it)" in err
    assert "--block-size that divides 300, or --max-seq-len 256 or --max-seq-len 320" in err


def test_an_artifact_value_says_its_key(capsys: Any, tmp_path: Path) -> None:
    path = _file(tmp_path, {**GOOD, "max_seq_len": 300, "kvcache_block_size": 64})
    code = cli.main(["check-config", "--rbln-config", path])
    err = capsys.readouterr().err
    assert code == 1 and f"block_size=64 (kvcache_block_size in {path}; --block-size sets it)" \
        in err


def test_a_config_error_pickles_as_its_words() -> None:
    with pytest.raises(ConfigError) as e:
        Config(lanes=4, kv_blocks=2)
    again = pickle.loads(pickle.dumps(e.value))
    assert isinstance(again, ConfigError) and str(again) == str(e.value)


# ------------------------------------------------------------------------------- serve's model
@pytest.mark.parametrize("argv,says", [
    (["--model", "tiny", "--runtime", "hf"],
     "--model tiny is the reference runtime's built-in model; --runtime hf takes tiny-llama or "
     "tiny-gemma3"),
    (["--model", "tiny-llama"], "--model tiny-llama is --runtime hf's"),
    (["--model", "/nonexistent"], "--model /nonexistent: no such directory; give a model "
                                  "directory with its tokenizer"),
    (["--runtime", "nope"], "--runtime nope: unknown; give one of"),
    (["--runtime", "rbln"], "--runtime rbln needs --compiled PATH"),
    (["--runtime", "rbln", "--compiled", "/nonexistent"], "--compiled /nonexistent: not a "
                                                          "directory"),
])
def test_serve_says_what_model_to_give(capsys: Any, argv: list[str], says: str) -> None:
    """`--model tiny --runtime hf` ended in a traceback about reaching the model hub."""
    assert says in _usage(capsys, ["serve", "--insecure-no-auth", *argv])


def test_serve_names_the_model_path_before_the_port(capsys: Any) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        err = _usage(capsys, ["serve", "--insecure-no-auth", "--model", "/nonexistent",
                              "--port", str(port)])
    assert "/nonexistent" in err and "cannot listen" not in err


@pytest.mark.parametrize("runtime,missing", [
    ("reference", "no tokenizer files (tokenizer.json"),
    ("hf", "no config.json, no weights (*.safetensors or pytorch_model*.bin), no tokenizer "
           "files"),
])
def test_an_empty_model_directory_is_said_at_once(capsys: Any, tmp_path: Path, runtime: str,
                                                  missing: str) -> None:
    """It gave transformers' tokenizer message after 21 s (hf: after loading torch)."""
    err = _usage(capsys, ["serve", "--insecure-no-auth", "--runtime", runtime, "--model",
                          str(tmp_path)])
    assert f"--model {tmp_path}: the directory has {missing}" in err


def test_a_checkpoint_transformers_cannot_load_is_one_line(tmp_path: Path) -> None:
    """Weights that are not a safetensors file: a SafetensorError traceback, exit 1."""
    pytest.importorskip("transformers")
    from atom_core.serve.tokenizer import build_tiny_tokenizer

    d = build_tiny_tokenizer(tmp_path / "model")
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    r = subprocess.run([sys.executable, "-m", "atom_core.cli", "serve", "--insecure-no-auth",
                        "--runtime", "hf", "--model", str(d), "--port", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    err = r.stderr
    assert r.returncode == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert f"--model {d}: cannot load the checkpoint (" in err
    assert "give a local checkpoint directory (config.json, its weights" in err


def test_the_hf_tiny_model_names_match_the_runtimes() -> None:
    pytest.importorskip("transformers")
    from atom_core.runtime import hf
    from atom_core.serve.runtimes import HF_TINY_MODELS

    assert HF_TINY_MODELS == hf.TINY_MODELS


# ---------------------------------------------------------------- before anything heavy loads
PROBE = """
import sys
from atom_core.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(sorted(m for m in ("torch", "transformers", "uvicorn", "fastapi") if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [
    ["serve", "--bogus-flag"],
    ["serve", "--request-timeout", "nan"],
    ["serve", "--max-se", "512"],
    ["serve"],  # no API key
    ["serve", "--insecure-no-auth", "--model", "/nonexistent"],
    ["serve", "--insecure-no-auth", "--runtime", "hf", "--model", "tiny"],
    ["serve", "--insecure-no-auth", "--max-seq-len", "300"],
    ["serve", "--insecure-no-auth", "--rbln-config", "/nonexistent/rbln_config.json"],
    ["pd-decode", "--timeout", "nan"],
    ["demo", "--requests", "0"],
])
def test_options_are_checked_before_torch_is_imported(argv: list[str]) -> None:
    """A bad flag took 10-12 s: torch loaded first. (Checked by what is imported, not by the
    time it takes.)"""
    env = {k: v for k, v in os.environ.items() if k != "ATOM_CORE_API_KEY"}
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.stdout.strip().splitlines()[-1] == "[]", (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
