"""Mutation tests of the exercise graders: each grader fails every small wrong edit of its reference (a mutant)
that changes the result, the traffic or the memory, beyond the wrong variants each grader's own test lists.

tests/mutants.py makes the mutants; a survivor must be argued equivalent in its KNOWN_EQUIVALENT. By default each
exercise grades a fixed sample of its mutants (all eight in a few minutes on 2 cores); DTLAB_MUTANTS=all grades
every one (``make mutants`` prints the kill rates as a table)."""

import ast
import os

import cloudpickle
import pytest
from mutants import (
    KNOWN_EQUIVALENT,
    LIMIT_S,
    MODULE,
    NEEDS_GPU,
    OPERATORS,
    edits,
    equivalent,
    grade,
    mutants,
    needs_gpu,
    original,
    sample,
)

from dtlab.exercises import EXERCISES, check

#: Mutants graded per exercise by default: one of several operators each, the same every run.
DEFAULT = 14
RING = "02.ring_all_reduce"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXERCISES))
def test_the_grader_fails_every_mutant_that_is_not_argued_equivalent(name):
    found = mutants(name)
    chosen = found if os.environ.get("DTLAB_MUTANTS") == "all" else sample(found, DEFAULT)
    # the reference built the mutants' way (by value, module __mutant__) passes: a mutant fails for its edit alone
    check(name, original(name), quiet=True, limit_s=LIMIT_S).raise_for_failure()
    outcomes = [grade(m) for m in chosen]
    survivors = [o.mutant for o in outcomes
                 if o.status == "survived" and equivalent(o.mutant) is None and needs_gpu(o.mutant) is None]
    assert not survivors, f"{name}: the grader passed {len(survivors)} of {len(chosen)} mutants:\n" + "\n".join(
        f"  {m.id!r}: {m.description}" for m in survivors)
    assert any(o.status == "killed" for o in outcomes), f"{name}: no mutant graded"


def test_the_ring_reference_gets_mutants_of_every_operator_its_code_has():
    found = mutants(RING)
    # the ring has no `and`/`or` and no `del`: those two are checked on a snippet below
    assert {m.operator for m in found} == set(OPERATORS) - {"boolop", "drop-del"}
    assert len({m.id for m in found}) == len(found) and len({m.source for m in found}) == len(found)
    assert [m.id for m in mutants(RING)] == [m.id for m in found], "the same mutants, in the same order, every time"
    snippet = ast.parse("def f(a, b):\n    '''Doc 1.'''\n    x = a and not b\n    del a\n    return x\n")
    found = edits(snippet, nested_only=False)
    labels = [label for label, *_ in found]
    assert "boolop:and->or" in labels and "drop-del" in labels and "unary:drop-not" in labels
    assert all(at.lineno != 2 for _, at, *_ in found), "the docstring is neither dropped nor moved"


def test_a_mutant_is_the_edited_code_defined_in_a_module_no_process_can_import():
    (mutant,) = [m for m in mutants(RING) if m.id.startswith("method:add_->copy_")]
    impl, reference = mutant.build(), original(RING)
    assert impl.__module__ == reference.__module__ == MODULE
    assert "add_" in reference.__code__.co_names
    assert "add_" not in impl.__code__.co_names and "copy_" in impl.__code__.co_names
    shipped = cloudpickle.loads(cloudpickle.dumps(impl))          # by value, as the grader's workers get it
    assert shipped.__code__.co_code == impl.__code__.co_code and shipped.__code__.co_names == impl.__code__.co_names


@pytest.mark.parametrize("listed", [KNOWN_EQUIVALENT, NEEDS_GPU], ids=["KNOWN_EQUIVALENT", "NEEDS_GPU"])
def test_every_mutant_argued_about_is_still_made(listed):
    for name, argued in listed.items():
        assert name in EXERCISES
        stale = set(argued) - {m.id for m in mutants(name)}
        assert not stale, f"{name}: mutants argued about that the reference no longer has: {sorted(stale)}"
        assert all(reason.strip() for reason in argued.values())
    assert not any(set(KNOWN_EQUIVALENT.get(name, {})) & set(argued) for name, argued in NEEDS_GPU.items())


def test_a_sample_is_fixed_and_leaves_out_the_mutants_argued_equivalent():
    found = mutants(RING)
    chosen = sample(found, DEFAULT)
    assert [m.id for m in chosen] == [m.id for m in sample(mutants(RING), DEFAULT)]
    assert len(chosen) == DEFAULT and not any(equivalent(m) for m in chosen)
