"""The package itself: `import dtlab` gives every module, and each module explains itself."""

import subprocess
import sys

import pytest

import dtlab

pytestmark = pytest.mark.cluster  # code a cluster runs: make test-runtime repeats these on its stack


def test_import_dtlab_then_use_any_module():
    code = "import dtlab; print(dtlab.checkpoint.save.__name__, dtlab.parallel.zero.ShardedOptimizer.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["save", "ShardedOptimizer"]


def test_an_unknown_module_lists_the_real_ones():
    with pytest.raises(AttributeError, match="Its modules: activations, advise, bandwidth, checkpoint"):
        dtlab.no_such_thing  # noqa: B018


def _every_module() -> list[str]:
    import pkgutil

    return sorted(m.name for m in pkgutil.walk_packages(dtlab.__path__, "dtlab."))


@pytest.mark.parametrize("name", _every_module())
def test_every_module_has_a_docstring_a_learner_can_read(name):
    import importlib

    module = importlib.import_module(name)
    assert module.__doc__ and len(module.__doc__.split()) > 10, f"{name} needs a docstring"


def test_every_public_module_on_disk_is_reachable_from_dtlab_and_named_in_its_map():
    """Nothing is listed by hand: a new file is ``dtlab.<name>`` at once (``website`` was missing from the
    hand-kept list), and ``help(dtlab)`` must say what it is."""
    from pathlib import Path

    on_disk = {p.stem if p.is_file() else p.name for p in Path(dtlab.__path__[0]).iterdir()
               if not p.name.startswith(("_", ".")) and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert set(dtlab.MODULES) == on_disk
    for name in on_disk:
        assert getattr(dtlab, name).__name__ == f"dtlab.{name}"
        assert f"dtlab.{name}" in dtlab.__doc__, f"dtlab's docstring does not say what dtlab.{name} is"


@pytest.mark.parametrize("old, name, new", [("memory", "model_states", "dtlab.planner.formulas"),
                                            ("composition", "Layout", "dtlab.planner.cost"),
                                            ("advise", "Advice", "dtlab.planner.advise")])
def test_old_planner_paths_keep_working_for_a_release_and_name_the_new_one(old, name, new):
    import importlib

    module = importlib.import_module(f"dtlab.{old}")
    with pytest.warns(DeprecationWarning, match=f"moved to {new}.{name}"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)


def test_a_removed_planner_function_names_its_replacement():
    from dtlab import memory

    with pytest.raises(AttributeError, match="dtlab.planner.advise.advise"):
        memory.plan_table  # noqa: B018


def test_the_wheel_holds_every_file_of_the_package(tmp_path):
    """The Databricks job installs dtlab as a wheel (databricks.yml, artifacts): a data file left out of it
    (the planner's published runs were) works here, from the source tree, and fails on the cluster."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tracked = subprocess.run(["git", "-C", str(root), "ls-files", "dtlab"], capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path), str(root)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("dtlab-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    assert set(tracked.stdout.split()) <= inside, sorted(set(tracked.stdout.split()) - inside)


@pytest.mark.parametrize("old", sorted(__import__("dtlab._moved", fromlist=["MOVED"]).MOVED))
def test_a_moved_modules_old_path_works_for_a_release_and_names_the_new_one(old):
    """Code written against last month's layout (``from dtlab import hardware``, ``import dtlab.course``) still
    runs, warned where each module lives now; the names it gets are the new module's own objects."""
    import importlib
    import subprocess
    import sys

    from dtlab._moved import MOVED

    new = importlib.import_module(MOVED[old])
    public = sorted(n for n in vars(new) if not n.startswith("_") and not isinstance(vars(new)[n], type(sys)))
    probe = (f"import warnings; warnings.simplefilter('always'); import dtlab\n"
             f"with warnings.catch_warnings(record=True) as caught:\n"
             f"    warnings.simplefilter('always')\n"
             f"    import dtlab.{old} as m\n"
             f"    import {MOVED[old]} as n\n"
             f"    same = all(getattr(m, k) is getattr(n, k) for k in {public[:5]!r})\n"
             f"    via_attr = getattr(dtlab, {old!r}) is m\n"
             f"print(same, via_attr, [str(w.message) for w in caught if 'moved to' in str(w.message)][:1])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True True"), out.stdout
    assert f"dtlab.{old} moved to {MOVED[old]}" in out.stdout


def test_a_moved_packages_submodules_keep_their_old_paths_too():
    import importlib

    with pytest.warns(DeprecationWarning, match="dtlab.clusters.bundle moved to dtlab.tooling.clusters.bundle"):
        old = importlib.import_module("dtlab.clusters.bundle")
    from dtlab.tooling.clusters import bundle

    with pytest.warns(DeprecationWarning, match="moved to dtlab.tooling.clusters.bundle.bundle_problems"):
        assert old.bundle_problems is bundle.bundle_problems


def test_one_held_elements_answers_for_a_plain_model_too():
    """What a rank holds, counted from the model itself: a Linear(3, 4) has 16 elements; SGD with momentum keeps
    one buffer per element after its first step, Adam two (its step counter is a scalar, not counted)."""
    import torch

    from dtlab.parallel import held_elements

    model = torch.nn.Linear(3, 4)
    for make, per_element in ((lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1), (torch.optim.Adam, 2)):
        optimizer = make(model.parameters())
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        assert held_elements(model, optimizer) == {"params": 16, "grads": 16, "optimizer": 16 * per_element}
        model.zero_grad(set_to_none=True)
    assert held_elements(model) == {"params": 16, "grads": 0, "optimizer": 0}


def test_the_planner_computes_with_the_standard_library_alone():
    """What lets a runtime stack on the course's own Python skip the planner's tests (tests/conftest.py,
    STDLIB_ONLY): pricing a cluster and reading the published records load no third-party library (matplotlib and
    ipywidgets only when a chart or a form is drawn), so the same interpreter gives the same answers."""
    code = ("import sys\n"
            "before = set(sys.modules)\n"        # what the interpreter's start loaded (.pth files: mpl_toolkits)
            "from dtlab.planner import advise, cost, formulas, hardware, kernels, memory, memory_record, published\n"
            "a = advise.advise(7e9, cluster='g5.12xlarge x4'); a.table(); published.runs()\n"
            "advise.advise(70e9, cluster='p4d.24xlarge x8', recompute='full', precision='fp16').table()\n"
            "found = {m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)\n"
            "print(sorted(m for m in found if not m.startswith('_') and m != 'dtlab'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"the planner loaded {out.stdout.strip()}: drop its tests from STDLIB_ONLY"
