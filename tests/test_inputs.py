"""Input from outside is parsed totally: `atom-core check-trace` on any bytes gives a verdict
naming a line (never a traceback or a MemoryError), and the batcher refuses ids that only look
like integers (bool, float) with a clear error instead of serving or aborting the wrong thing."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_core import cli
from atom_core.batcher import AtomBatcher
from atom_core.config import Config
from atom_core.replay import MAX_LINE_BYTES, read_lines, replay
from atom_core.runtime import TorchReferenceRuntime


@pytest.fixture(scope="module")
def good_trace() -> list[bytes]:
    """A real trace: a few requests through a batcher with the prefix cache."""
    cfg = Config(lanes=2, kv_blocks=5, max_seq_len=128, prefill_chunk=64, prefix_cache=True)
    buf = io.StringIO()
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), trace=buf)
    for p in ([1, 2, 3] * 30, [1, 2, 3] * 30 + [4], [7] * 10):
        b.submit(p, 3)
    b.run_until_done()
    lines = buf.getvalue().encode().splitlines(keepends=True)
    assert replay(lines).ok and len(lines) > 10
    return lines


def verdict_of(data: bytes):
    v = replay(read_lines(io.BytesIO(data)))
    assert isinstance(v.ok, bool)
    if not v.ok:  # a bad trace always names its line and says what is wrong
        assert v.line is not None and v.line >= 1 and v.error
    return v


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=400))
def test_random_bytes_give_a_verdict(data: bytes) -> None:
    assert not verdict_of(data).ok or data.strip() == b""


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                    | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_traces_give_a_verdict(good_trace: list[bytes], data: st.DataObject) -> None:
    """Replace one line's field (consts, action, an argument, the effects) by arbitrary JSON,
    or cut, duplicate or drop lines: a verdict, never an exception."""
    lines = list(good_trace)
    i = data.draw(st.integers(0, len(lines) - 1), label="line")
    rec = json.loads(lines[i])
    how = data.draw(st.sampled_from(["field", "arg", "cut", "dup", "drop"]), label="how")
    if how == "field":
        key = data.draw(st.sampled_from(sorted(rec)), label="key")
        rec[key] = data.draw(JSON, label="value")
        lines[i] = json.dumps(rec).encode() + b"\n"
    elif how == "arg" and isinstance(rec.get("args"), dict) and rec["args"]:
        key = data.draw(st.sampled_from(sorted(rec["args"])), label="arg")
        rec["args"][key] = data.draw(JSON, label="value")
        lines[i] = json.dumps(rec).encode() + b"\n"
    elif how == "arg" and "consts" in rec:
        key = data.draw(st.sampled_from(sorted(rec["consts"])), label="const")
        rec["consts"][key] = data.draw(JSON | st.integers(0, 2**40), label="value")
        lines[i] = json.dumps(rec).encode() + b"\n"
    elif how == "cut":
        lines[i] = lines[i][:data.draw(st.integers(0, len(lines[i])), label="at")]
    elif how == "dup":
        lines.insert(i, lines[i])
    else:
        del lines[i]
    verdict_of(b"".join(lines))


@pytest.mark.parametrize("bad, says", [
    (b"", "empty trace"),
    (b'{"consts": {"B": 2}}\n', "first line"),
    (b'{"consts": {"B": 100000, "K": 100000, "C": 64, "S": 64, "PREFIX": false, '
     b'"RESERVED": false, "SCRATCH": 0}}\n', "too large"),
    (b'{"consts": {"B": true, "K": 3, "C": 64, "S": 64, "PREFIX": false, '
     b'"RESERVED": false, "SCRATCH": 0}}\n', "not an integer"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested too deeply"),
    (b'{"consts": "\xff\xfe"}\n', "not UTF-8"),
])
def test_malformed_first_lines(bad: bytes, says: str) -> None:
    v = verdict_of(bad)
    assert not v.ok and v.line == 1 and says in v.error, v.error


def test_bad_steps_name_their_line(good_trace: list[bytes]) -> None:
    head = good_trace[0]
    for step, says in [(b'{"action": "decode", "args": {"lpad": 0, "pad": 0, "tok": [1, 2, 3]}}',
                        "one entry per lane"),
                       (b'{"action": "submit", "args": {"r": 0, "p": [1, true]}}',
                        "list of integers"),
                       (b'{"action": "submit", "args": {"r": 0, "p": "abc"}}',
                        "list of integers"),
                       (b'{"action": ["x"], "args": {}}', "unknown action"),
                       (b"[1, 2]", "must be an object"),
                       (b'{"args": {}}', "no 'action'"),
                       (b"\xc3\x28", "not UTF-8")]:
        v = verdict_of(head + step + b"\n")
        assert not v.ok and v.line == 2 and says in v.error, (step, v.error)


def test_an_overlong_line_is_refused_without_reading_it_whole(tmp_path, capsys) -> None:
    path = tmp_path / "long.jsonl"
    path.write_bytes(b'{"consts": ' + b" " * (MAX_LINE_BYTES + 10) + b"}\n")
    assert cli.main(["check-trace", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("line 1:") and "longer than" in out


def test_cli_on_invalid_utf8_gives_a_verdict(tmp_path, capsys) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage\n")
    assert cli.main(["check-trace", str(path)]) == 1
    assert capsys.readouterr().out.startswith("line 1: first line")


# --------------------------------------------------------------------------- batcher inputs
@pytest.fixture
def batcher() -> AtomBatcher:
    cfg = Config(lanes=2, kv_blocks=3, max_seq_len=128, prefill_chunk=64)
    return AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg))


@pytest.mark.parametrize("kwargs, says", [
    (dict(prompt_ids=[1, True, 3], max_new_tokens=2), "must be integers"),
    (dict(prompt_ids=[1, 2.0], max_new_tokens=2), "must be integers"),
    (dict(prompt_ids=[1, 2], max_new_tokens=True), "max_new_tokens"),
    (dict(prompt_ids=[1, 2], max_new_tokens=2.5), "max_new_tokens"),
    (dict(prompt_ids=[1, 2], max_new_tokens=2, eos_token_id=1.0), "eos_token_id"),
    (dict(prompt_ids=[1, 2], max_new_tokens=2, eos_token_id=False), "eos_token_id"),
])
def test_submit_refuses_ids_that_only_look_like_integers(batcher, kwargs, says) -> None:
    with pytest.raises(ValueError, match=says):
        batcher.submit(**kwargs)
    assert not batcher.requests and not batcher.busy()  # nothing was queued


def test_abort_refuses_a_non_integer_id(batcher) -> None:
    rid = batcher.submit([1, 2, 3], 4)
    for bad in (0.0, False, "0", None):
        with pytest.raises(ValueError, match="request ids are integers"):
            batcher.abort(bad)
    assert not batcher.requests[rid].ended  # 0.0 == 0 did not abort it
    assert batcher.abort(rid) and batcher.requests[rid].error == "aborted"
