"""`atom-core serve` takes a vLLM launch line: vLLM's names of atom-core's settings are aliases,
a vLLM flag atom-core has no use for is accepted (when its value matches what atom-core does) or
refused naming it and saying why, the model is given as `vllm serve MODEL` gives it and is the
served model's id, and max_seq_len defaults to the checkpoint's context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atom_core import cli
from atom_core.config import min_kv_blocks
from atom_core.serve import vllm_flags as vf
from atom_core.serve.main import check
from atom_core.serve.runtimes import TINY_DEFAULTS, ServeOptions, config_for

pytest.importorskip("fastapi")


def parse(*argv: str):
    return cli.build_parser().parse_args(["serve", "--insecure-no-auth", *argv])


def refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("vllm", "ours", "value"), [
    ("--max-num-seqs", "lanes", "8"), ("--max-model-len", "max_seq_len", "512"),
    ("--num-gpu-blocks-override", "kv_blocks", "40"), ("--uvicorn-log-level", "log_level",
                                                       "debug")])
def test_vllm_names_are_aliases(vllm: str, ours: str, value: str) -> None:
    want = int(value) if value.isdigit() else value
    assert getattr(parse(vllm, value), ours) == want
    assert getattr(parse(f"--{ours.replace('_', '-')}", value), ours) == want


def test_prefix_caching_both_spellings() -> None:
    assert parse("--enable-prefix-caching").prefix_cache is True
    assert parse("--no-enable-prefix-caching").prefix_cache is False
    assert parse().prefix_cache is None  # (the runtime's default: on)


@pytest.mark.parametrize("flag", [f for f, a in vf.VLLM_FLAGS.items()
                                  if isinstance(a, vf.Refused)])
def test_each_refused_flag_is_named_with_why(capsys, flag: str) -> None:
    a = vf.VLLM_FLAGS[flag]
    argv = [flag, "1"] if a.takes_value else [flag]  # type: ignore[union-attr]
    err = refused(capsys, *argv)
    assert f"{flag} is vLLM's; atom-core does not have it: {a.why}" in err  # type: ignore


@pytest.mark.parametrize("flag", [f for f, a in vf.VLLM_FLAGS.items()
                                  if isinstance(a, vf.Only)])
def test_one_value_flags_take_their_value_and_refuse_others(capsys, flag: str) -> None:
    a = vf.VLLM_FLAGS[flag]
    parse(flag, a.value)  # type: ignore[union-attr]
    err = refused(capsys, flag, "7")
    assert f"{flag} 7: atom-core takes only {a.value}" in err  # type: ignore[union-attr]


def test_short_spellings_and_no_ops_are_accepted(capsys) -> None:
    noops = [f for f, a in vf.VLLM_FLAGS.items() if isinstance(a, vf.NoOp)]
    args = parse("-tp", "1", "-pp", "1", *noops)
    assert not hasattr(args, "enforce_eager")  # (nothing of theirs reaches the options)
    assert "-q" in refused(capsys, "-q", "awq")


def test_every_vllm_flag_is_recognised() -> None:
    """No flag of the table is 'unrecognized arguments' (each is one of the four answers)."""
    names = {s for a in cli.build_parser()._subparsers._group_actions[0].choices["serve"]
             ._actions for s in a.option_strings}
    assert set(vf.VLLM_FLAGS) <= names
    assert all(isinstance(a, (vf.Alias, vf.NoOp, vf.Only, vf.Refused))
               for a in vf.VLLM_FLAGS.values())


def test_model_positional_is_the_served_id(tmp_path: Path) -> None:
    """`serve MODEL` as `vllm serve MODEL`; the id clients send is the model as given."""
    args = parse("tiny")
    check(args)
    assert args.model == "tiny"
    args = parse("tiny", "--model", "tiny")
    check(args)
    with pytest.raises(ValueError, match="the model is given twice"):
        check(parse(str(tmp_path), "--model", "tiny"))


def checkpoint_dir(tmp_path: Path, context: int) -> Path:
    from atom_core.serve.tokenizer import build_tiny_tokenizer

    d = build_tiny_tokenizer(tmp_path / "model")
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
    return d


def test_max_seq_len_defaults_to_the_checkpoints_context(tmp_path: Path) -> None:
    d = str(checkpoint_dir(tmp_path, 1000))
    cfg = config_for(ServeOptions(model=d, overrides={"lanes": 2}), TINY_DEFAULTS)
    assert cfg.max_seq_len == 960  # whole 64-token blocks within 1000
    assert cfg.kv_blocks == min_kv_blocks(2, True, "dynamic", 960 // 64)
    # --kv-blocks caps it at the longest table the blocks give every lane
    blocks = min_kv_blocks(2, True, "dynamic", 5)
    cfg = config_for(ServeOptions(model=d, overrides={"lanes": 2, "kv_blocks": blocks}),
                     TINY_DEFAULTS)
    assert cfg.max_seq_len == 5 * 64
    # given, it wins; the tiny model keeps its 256
    cfg = config_for(ServeOptions(model=d, overrides={"lanes": 2, "max_seq_len": 128}),
                     TINY_DEFAULTS)
    assert cfg.max_seq_len == 128
    assert config_for(ServeOptions(model="tiny"), TINY_DEFAULTS).max_seq_len == 256


def test_tokenizer_and_chat_template_flags(tmp_path: Path) -> None:
    from atom_core.serve.main import build

    d = checkpoint_dir(tmp_path, 512)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    _app, engine, settings = build(parse("--tokenizer", str(d), "--chat-template",
                                         str(template), "--max-model-len", "256"))
    assert settings.model_name == "tiny" and engine.batcher.config.max_seq_len == 256
    tok = _app.state.tokenizer
    assert tok.decode(tok.chat([{"role": "user", "content": "hi"}])) == "[hi]"
    with pytest.raises(ValueError, match="--chat-template: --model tiny has the byte"):
        check(parse("--chat-template", "{{ x }}"))
    with pytest.raises(ValueError, match="--tokenizer .*no such directory"):
        check(parse("--tokenizer", str(tmp_path / "nope")))


def test_the_readme_table_is_the_codes() -> None:
    """README's table of vLLM's flags says, for each, what the code does."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for flag in vf.VLLM_FLAGS:
        assert f"| `{flag}` | {vf.answer(flag)} |" in readme, flag


def test_help_shows_the_queue_default_and_vllm_names(capsys) -> None:
    from atom_core.serve.main import DEFAULT_QUEUE

    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"(default: {DEFAULT_QUEUE})" in out and "vLLM: --max-num-seqs" in out
