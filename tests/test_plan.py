"""AtomBatcher's plan/complete split: a batcher driven by hand (`plan()`, the runtime call the
plan names, `complete()`) produces the same tokens, events and core states as one driven by
`step()`, with paged tables, the prefix cache, preemption and a failing runtime call; and
`complete()` without a pending plan, or twice for one, is a clear error."""

from __future__ import annotations

import random

import pytest
import torch

from atom_core.batcher import AtomBatcher, Event
from atom_core.config import Config
from atom_core.runtime import TorchReferenceRuntime

_rng = random.Random(7)
SHARED = [_rng.randrange(128) for _ in range(140)]
PROMPTS = [SHARED + [_rng.randrange(128) for _ in range(n)] for n in (3, 60, 9, 80, 1)]


def _pair(**kw) -> tuple[AtomBatcher, AtomBatcher]:
    cfg = Config(lanes=2, max_seq_len=256, prefill_chunk=64, **kw)
    rt = TorchReferenceRuntime.tiny(cfg)  # one model for both: same weights, same tokens
    return (AtomBatcher(cfg, rt, ghost=True), AtomBatcher(cfg, rt, ghost=True))


class _FailOnce:
    """The runtime, whose `fail_at`-th call raises."""

    def __init__(self, rt: object, fail_at: int) -> None:
        self._rt, self._fail_at, self._calls = rt, fail_at, 0

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._rt, name)
        if name not in ("prefill", "decode"):
            return attr

        def call(*args: object) -> object:
            self._calls += 1
            if self._calls - 1 == self._fail_at:
                raise RuntimeError("device lost")
            return attr(*args)
        return call


@pytest.mark.parametrize("kw", [
    {"kv_blocks": 12, "block_size": 64, "prefix_cache": True},
    {"kv_blocks": 6, "block_size": 64, "prefix_cache": True, "preemption": True},
    {"kv_blocks": 3, "prefix_cache": False},
], ids=["paged-prefix", "preempt", "one-block"])
@pytest.mark.parametrize("fail", [None, 3])
def test_plan_complete_by_hand_is_step(kw, fail):
    a, b = _pair(**kw)
    if fail is not None:
        b.runtime = _FailOnce(b.runtime, fail)  # type: ignore[assignment]
    for p in PROMPTS:
        a.submit(p, 12)
        b.submit(p, 12)
    calls = 0
    for _ in range(400):
        if not (a.busy() or b.busy()):
            break
        plan = a.plan()
        assert (plan.call is None) or plan.lanes
        if plan.call == "decode":
            assert len(plan.lanes) + len(plan.padding) == a.config.lanes
            assert plan.tables.shape == (a.config.lanes, a.config.blocks_per_table)
        failed = fail is not None and plan.call is not None and calls == fail
        if plan.call is None:
            got = a.complete()
        elif failed:
            got = a.complete(error=RuntimeError("device lost"))
        else:
            got = a.complete(getattr(a.runtime, plan.call)(*plan.args()))
        calls += plan.call is not None
        assert got == b.step()
        assert a.state == b.state
        a.check_invariants()
    assert not a.busy()
    assert {r: (q.tokens, q.error) for r, q in a.requests.items()} == \
        {r: (q.tokens, q.error) for r, q in b.requests.items()}
    assert a.stats == b.stats
    if fail is not None:
        assert a.stats.runtime_errors >= 1
    if kw.get("preemption"):
        assert a.stats.preemptions >= 1
    if kw.get("prefix_cache"):
        assert a.stats.prefix_hit_tokens > 0


def test_complete_without_a_plan_or_twice_is_an_error():
    a, _ = _pair(kv_blocks=3)
    with pytest.raises(RuntimeError, match="without a pending plan"):
        a.complete()
    a.submit(PROMPTS[0], 4)
    plan = a.plan()
    assert plan.call == "prefill" and plan.lanes == (0,)
    with pytest.raises(RuntimeError, match="while a plan is pending"):
        a.plan()
    a.complete(a.runtime.prefill(*plan.args()))
    with pytest.raises(RuntimeError, match="without a pending plan"):
        a.complete(torch.zeros(1, 64, 128))


def test_submit_between_plan_and_complete_keeps_the_plan_abort_is_refused():
    """abort() between plan() and complete() is refused with nothing changed (the planned call
    may have run already: refusing the step afterwards would run it twice, which shifts a
    hybrid model's sliding windows; tests/test_batcher_audit.py), and works after complete()."""
    a, b = _pair(kv_blocks=3)
    r0 = a.submit(PROMPTS[0], 4)
    b.submit(PROMPTS[0], 4)
    plan = a.plan()
    a.submit(PROMPTS[1], 4)  # (a new waiting request changes nothing the plan chose)
    got = a.complete(a.runtime.prefill(*plan.args()))
    b_got = b.step()
    b.submit(PROMPTS[1], 4)
    assert got == b_got
    plan = a.plan()
    before = a.state
    with pytest.raises(RuntimeError, match=r"abort\(\) while a plan is pending"):
        a.abort(r0)
    assert a.state == before and not a.requests[r0].ended
    assert a.complete(getattr(a.runtime, plan.call)(*plan.args())) == b.step()
    assert a.abort(r0) and a.requests[r0].error == "aborted"
    a.step()  # the batcher goes on
    a.check_invariants()


def test_complete_with_tokens_sampled_elsewhere_is_step():
    """An engine that samples itself passes tokens (greedy here: the same as step's argmax);
    a token outside the vocabulary fails its request alone."""
    a, b = _pair(kv_blocks=12, block_size=64, prefix_cache=True)
    for p in PROMPTS:
        a.submit(p, 12)
        b.submit(p, 12)
    while a.busy() or b.busy():
        plan = a.plan()
        if plan.call is None:
            got = a.complete()
        else:
            logits = getattr(a.runtime, plan.call)(*plan.args())
            got = a.complete(tokens=torch.argmax(logits[:, -1, :], dim=-1).tolist())
        assert got == b.step()
        assert a.state == b.state
    assert {r: q.tokens for r, q in a.requests.items()} == \
        {r: q.tokens for r, q in b.requests.items()}

    a, _ = _pair(kv_blocks=3)
    bad, good = a.submit([1, 2, 3], 4), a.submit([4, 5], 4)
    assert a.plan().call == "prefill"
    a.complete(tokens=[5])
    assert a.plan().call == "prefill"
    a.complete(tokens=[7])
    plan = a.plan()
    assert plan.call == "decode" and plan.lanes == (0, 1)
    events = a.complete(tokens=[128, 9])  # 128: outside the tiny model's vocabulary
    assert a.requests[bad].ended and "token rejected" in a.requests[bad].error
    assert Event("token", good, token=9) in events and not a.requests[good].ended
    a.run_until_done()
    assert a.requests[good].error is None and len(a.requests[good].tokens) == 4
