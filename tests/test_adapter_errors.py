"""Clear errors instead of crashes: a runtime that is not the configured artifact, and traces
with ids that name no lane or block."""

import io
import json

import pytest

from atom_core import AtomBatcher, Config
from atom_core.replay import replay
from atom_core.runtime import TorchReferenceRuntime


def test_runtime_must_match_the_config():
    rt = TorchReferenceRuntime.tiny(Config(lanes=4, kv_blocks=4, max_seq_len=128,
                                           prefill_chunk=64))
    with pytest.raises(ValueError) as e:
        AtomBatcher(Config(lanes=2, kv_blocks=2, max_seq_len=128, prefill_chunk=64), rt)
    msg = str(e.value)
    assert "num_blocks: config 2, runtime 4" in msg and "lanes: config 2" in msg


def _trace() -> list[str]:
    cfg = Config(lanes=1, kv_blocks=2, max_seq_len=128, prefill_chunk=64)
    out = io.StringIO()
    b = AtomBatcher(cfg, TorchReferenceRuntime.tiny(cfg), trace=out)
    b.submit([1, 2, 3], 2)
    b.run_until_done()
    return out.getvalue().splitlines()


@pytest.mark.parametrize("bad,expect", [(99, "dst=99 is not a Block (0..1)"),
                                        ("x", "dst='x' is not an integer"),
                                        (True, "dst=True is not an integer")])
def test_replay_reports_bad_ids_at_their_line(bad, expect):
    lines = _trace()
    i = next(n for n, ln in enumerate(lines) if '"admit_miss"' in ln)
    rec = json.loads(lines[i])
    rec["args"]["dst"] = bad
    lines[i] = json.dumps(rec)
    v = replay(lines)
    assert not v.ok and v.line == i + 1 and expect in v.error
