"""The README's capacity table and commands are the proved and real ones."""

import re
from pathlib import Path

from atom_core._generated import capacity

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _cell(offset: int) -> str:
    return "K >= B" + (f" + {offset}" if offset else "")


def test_capacity_table_matches_the_proofs():
    rows = {m.group(1).strip(): (m.group(2).strip(), m.group(3).strip()) for m in re.finditer(
        r"^\| (no prefix cache|prefix cache)\s*\|([^|]+)\|([^|]+)\|$", README, re.M)}
    assert rows == {
        "no prefix cache": (_cell(capacity.OFFSETS[(False, "reserved")]),
                            _cell(capacity.OFFSETS[(False, "dynamic")])),
        "prefix cache": (_cell(capacity.OFFSETS[(True, "reserved")]),
                         _cell(capacity.OFFSETS[(True, "dynamic")])),
    }


def test_first_lines_are_the_two_commands():
    block = README.split("```")[1]
    assert [ln.split("#")[0].strip() for ln in block.strip().splitlines()] == [
        "make verify", "make test"]


def test_preemption_rule_matches_the_proofs():
    """The README's preemption sentence: K >= T + 1 beside other lanes (every feature key),
    T for one lane with dynamic scratch, T + 1 for one lane with reserved scratch."""
    assert "`K >= T + 1` (`T` for one lane with dynamic\nscratch)" in README
    for (_prefix, scratch), (lone, shared) in capacity.PREEMPT_BLOCKS.items():
        assert shared == 1
        assert lone == (0 if scratch == "dynamic" else 1)


# --------------------------------------------------------------------------- "What is proved"
def _what_is_proved() -> str:
    start = README.index("## What is proved")
    return README[start:README.index("\n## ", start + 1)]


def _bullet(section: str, title: str) -> str:
    """The bullet of `section` whose bold title starts with `title` (up to the next one)."""
    start = section.index(f"- **{title}")
    nxt = section.find("\n- **", start + 1)
    return section[start:nxt if nxt != -1 else len(section)]


def _model_names():
    from atom_core.spec.model import MODEL

    m = MODEL
    return m, ({i.name for i in m.invariants} | {t.name for t in m.transition_invariants}
               | {p.name for p in m.progress} | {a.name for a in m.actions}
               | {g for a in m.actions for g, _ in a.guards} | {a.name for a in m.axioms}
               | {law.name for law in m.laws} | {f.name for f in m.state})


def test_every_name_the_claims_use_is_in_the_model():
    """A claim about an invariant (or guard, action, property) that does not exist is false:
    every snake_case name in backticks in "What is proved" is one of the model's."""
    _m, names = _model_names()
    used = set(re.findall(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`", _what_is_proved()))
    assert used
    assert used - names == set()


def test_the_safety_properties_are_the_models():
    """The safety bullet names exactly the invariants the spec marks `m.safety`, and each is a
    relational one (proved for all sizes, as the bullet says)."""
    m, _names = _model_names()
    named = re.findall(r"`([a-z_]+)`", _bullet(_what_is_proved(), "Safety properties"))
    assert set(named) - {"m.safety"} == set(m.safety_properties)
    kinds = {i.name: i.kind for i in m.invariants}
    assert {kinds[n] for n in m.safety_properties} == {"relational"}


def test_bounded_invariants_and_their_fixed_constants_are_stated():
    """The bounded invariants by name (exactly the model's), the cutoff `verify` uses, and the
    constants the bounded checks fix (chunk, block size, requests, host slots)."""
    from atom_core.proofs import checks, run

    m, _names = _model_names()
    bullet = _bullet(_what_is_proved(), "Bounded invariants")
    named = set(re.findall(r"`([a-z_]+)`", bullet))
    assert named == {i.name for i in m.invariants if i.kind == "bounded"}
    arith = set(re.findall(r"`([a-z_]+)`", _bullet(_what_is_proved(), "Arithmetic invariants")))
    assert arith == {i.name for i in m.invariants if i.kind == "arithmetic"}
    assert f"B <= {run.MAX_LANES}, K <= {run.MAX_BLOCKS}" in bullet
    lanes = 3
    u = checks.bounded_universe(m, lanes, 1)
    extra = u.sizes["Req"] - lanes
    fixed = [f"chunk {checks.CHUNK}", f"block size {checks.SEQ_LEN}",
             f"B + {extra} requests" if extra else "B requests",
             f"{u.sizes['Slot']} host slots"]
    flat = " ".join(bullet.split())
    assert [f for f in fixed if f not in flat] == []


def test_every_progress_property_and_transition_invariant_is_described():
    m, _names = _model_names()
    section = _what_is_proved()
    progress = _bullet(section, "Progress")
    assert [p.name for p in m.progress if f"`{p.name}`" not in progress] == []
    assert "enabled" in progress  # what a progress property says: an action is enabled
    trans = _bullet(section, "Transition invariants")
    assert [t.name for t in m.transition_invariants if f"`{t.name}`" not in trans] == []


def test_the_unaligned_eager_sizes_are_stated():
    """The block size, chunk and cutoff of `verify`'s unaligned part, as the code has them."""
    from atom_core.proofs import checks

    flat = " ".join(_bullet(_what_is_proved(), "Eager blocks that are not").split())
    assert (f"block size {checks.UNALIGNED_SEQ_LEN} (chunk {checks.CHUNK})" in flat
            and f"B <= {checks.UNALIGNED_LANES}, K <= {checks.UNALIGNED_BLOCKS}" in flat
            and checks.UNALIGNED_SEQ_LEN % checks.CHUNK), flat


def test_the_scheduler_example_runs():
    """The README's example of driving the Scheduler without a runtime runs as written."""
    fence = "`" * 3
    blocks = README.split(fence + "python\n")[1:]
    (example,) = [b.split(fence)[0] for b in blocks if "from atom_core.scheduler import" in b]
    exec(compile(example, "README.md", "exec"), {})
