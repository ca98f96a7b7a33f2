"""The actions as typed records (atom_core/_generated/choices.py): generated from the spec's
action signatures, one per action, and what the policy returns and the scheduler applies."""

from __future__ import annotations

import attrs
import pytest

from atom_core._generated import choices, core, inplace
from atom_core.config import Config
from atom_core.policy import Policy
from atom_core.seq import TokSeq, seq
from atom_core.spec import codegen
from atom_core.spec.codegen.analysis import GenerationError
from atom_core.spec.model import MODEL

# a sort's Python type in the core (the generator's `py_type`, written out here independently)
KIND_TYPES = {"bool": bool, "int": int, "index": int, "enum": int, "ident": int,
              "value": TokSeq}


def _expected_type(sort: object) -> object:
    if sort.kind == "fn":  # type: ignore[attr-defined]
        inner = _expected_type(sort.ret)  # type: ignore[attr-defined]
        for _ in sort.args:  # type: ignore[attr-defined]
            inner = tuple[inner, ...]  # type: ignore[valid-type]
        return inner
    return KIND_TYPES[sort.kind]  # type: ignore[attr-defined]


def test_every_action_has_its_record_in_spec_order() -> None:
    assert list(choices.CHOICES) == [a.name for a in MODEL.actions]
    assert len(set(choices.CHOICES.values())) == len(MODEL.actions)


@pytest.mark.parametrize("action", MODEL.actions, ids=lambda a: a.name)
def test_fields_match_the_signature(action: object) -> None:
    cls = choices.CHOICES[action.name]  # type: ignore[attr-defined]
    params = action.params  # type: ignore[attr-defined]
    fields = attrs.fields(cls)
    assert [f.name for f in fields] == [p.name for p in params]
    assert [f.type for f in fields] == [_expected_type(p.sort) for p in params]
    assert cls.action == action.name  # type: ignore[attr-defined]
    # the core's own table agrees: names in the same order
    assert core.ACTIONS[action.name][2] == tuple(p.name for p in params)  # type: ignore


def test_records_are_frozen_typed_and_read_as_the_old_pair() -> None:
    grow = choices.Grow(l=1, dst=5)
    assert (grow.action, grow.args, grow.values) == ("grow", {"l": 1, "dst": 5}, (1, 5))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        grow.dst = 6  # type: ignore[misc]
    with pytest.raises(TypeError):
        choices.Grow(l=1, block=5)  # type: ignore[call-arg]
    # two actions with the same parameters are different choices (a tuple would compare equal)
    assert choices.ImportGrow(l=1, dst=5) != grow
    assert choices.AdmitMiss(l=0, r=1, dst=2) != choices.AdmitImport(l=0, r=1, dst=2)


@pytest.mark.parametrize("on", [core, inplace], ids=["core", "inplace"])
def test_apply_runs_the_action_on_either_core(on: object) -> None:
    cfg = Config(lanes=2, kv_blocks=4, max_seq_len=128, block_size=128, prefill_chunk=64)
    s = on.init(cfg.consts(), ghost=False)  # type: ignore[attr-defined]
    step = choices.Submit(r=0, p=seq([3, 4, 5])).apply(on, s)  # type: ignore[arg-type]
    assert step.rejected is None
    s = step.state
    choice = Policy().admission(s, 0)
    assert isinstance(choice, choices.AdmitMiss) and choice.r == 0
    step = choice.apply(on, s)  # type: ignore[arg-type]
    assert step.rejected is None and [type(e) for e in step.effects] == [core.Admit]
    assert step.effects[0] == core.Admit(lane=choice.l, request=0, block=choice.dst)
    # a refused record names the guard, as the action called by name does
    again = choices.AdmitMiss(l=choice.l, r=0, dst=choice.dst).apply(on, step.state)
    assert again.rejected is not None


def test_a_record_name_the_module_defines_is_refused() -> None:
    m = MODEL.copy()
    m.actions[0].name = "choice"  # its record would be `Choice`, the union's name
    with pytest.raises(GenerationError, match="clashes"):
        codegen.ChoicesGenerator(m).source()


def test_the_committed_records_are_the_generated_ones() -> None:
    fresh = codegen.generate()["choices.py"]
    assert fresh == (codegen.output_dir() / "choices.py").read_text()
