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
