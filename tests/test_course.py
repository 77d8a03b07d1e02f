import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from dtlab.tooling import cli
from dtlab.tooling import runner as course

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _notebook(path, params_src, body_src, ci=None):
    nb = new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                                "dtlab": {"ci_parameters": ci or {}}})
    first = new_code_cell(params_src)
    first.metadata["tags"] = ["parameters"]
    nb.cells = [first, new_code_cell(body_src)]
    nbformat.write(nb, path)


@pytest.fixture
def toy_course(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    _notebook(nbs / "00_ok.ipynb", "x = 1",
              "import os\nopen('marker.txt', 'w').write('here')\nprint('double', x * 2, os.environ['DTLAB_HEADLESS'])",
              ci={"x": 5})
    _notebook(nbs / "01_bad.ipynb", "y = 1", "raise ValueError('boom')")
    return nbs


@pytest.mark.parametrize("items, expected", [
    (["epochs=3", "lr=1e-3", "backend=gloo", "flag=True", "n=None", "sizes=[1, 2]", "s='a b'"],
     {"epochs": 3, "lr": 1e-3, "backend": "gloo", "flag": True, "n": None, "sizes": [1, 2], "s": "a b"}),
    (["expr=1+"], {"expr": "1+"}),
])
def test_parse_params(items, expected):
    assert course.parse_params(items) == expected


@pytest.mark.parametrize("bad", ["epochs", "=3", "1x=2", "a b=3"])
def test_malformed_params_show_the_format(bad):
    with pytest.raises(course.CourseError, match="Format: -p name=value"):
        course.parse_params([bad])


def test_old_lesson_names_run_what_they_named_and_renumbered_numbers_say_so(capsys):
    available = course.find_notebooks(NOTEBOOKS)
    split = course.resolve(["12_fsdp_and_sharded_checkpoints"], available)
    assert [p.stem for p in split] == ["12_fsdp", "13_sharded_checkpoints"]
    assert "now 12_fsdp and 13_sharded_checkpoints" in capsys.readouterr().err
    assert [p.stem for p in course.resolve(["19_choosing_a_strategy.ipynb"], available)] == ["20_choosing_a_strategy"]
    assert [p.stem for p in course.resolve(["13"], available)] == ["13_sharded_checkpoints"]
    assert "what was 13 (13_tensor_parallelism) is now 14_tensor_parallelism" in capsys.readouterr().err
    course.resolve(["03"], available)
    assert capsys.readouterr().err == ""                     # lessons 00-11 kept their numbers: no note
    every_new = {new for news in course.RENAMED.values() for new in news}
    assert every_new <= {p.stem for p in available}, "each old name forwards to a lesson that exists"


def test_resolve_by_number_stem_and_file_name():
    available = course.find_notebooks(NOTEBOOKS)
    first = available[0]
    assert course.resolve(["00"], available) == [first]
    assert course.resolve([first.stem, first.name], available) == [first, first]
    assert course.resolve([], available) == available


def test_unknown_notebook_lists_valid_names():
    available = course.find_notebooks(NOTEBOOKS)
    with pytest.raises(course.CourseError, match=f"Valid names: {available[0].stem}"):
        course.resolve(["99_nothing"], available)


@pytest.mark.parametrize("argv, message", [
    (["course", "run", "99"], "unknown notebook '99'. Valid names: 00_environment"),
    (["course", "run", "00", "-p", "epochs"], "Format: -p name=value"),
    (["course", "run", "00", "-p", "no_such_knob=1"], "not declared by 00_environment. Valid: backend"),
])
def test_cli_bad_input_exits_2_with_a_clear_message(argv, message, capsys, tmp_path):
    assert cli.main(argv + ["--runs", str(tmp_path), "--notebooks", str(NOTEBOOKS)]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [], "no run folder for rejected input"


def test_run_executes_reports_failures_and_writes_a_summary(toy_course, tmp_path, capsys):
    code = cli.main(["course", "run", "--notebooks", str(toy_course), "--runs", str(tmp_path / "runs"),
                     "-p", "x=3", "-q"])
    assert code == 1  # one notebook failed
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(r["notebook"], r["status"]) for r in summary] == [("00_ok", "ok"), ("01_bad", "failed")]
    assert summary[0]["parameters"] == {"x": 3}
    assert summary[1]["failing_cell"] is not None and summary[1]["error"] == "ValueError: boom"
    executed = nbformat.read(run_dir / "00_ok.ipynb", as_version=4)
    assert "double 6 1" in "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    assert (run_dir / "marker.txt").read_text() == "here", "notebooks run inside their run folder"
    assert "| 01_bad | failed |" in (run_dir / "summary.md").read_text()
    out = capsys.readouterr().out
    assert "1/2 notebooks ok" in out and "ValueError: boom" in out


def test_ci_parameters_come_from_notebook_metadata(toy_course, tmp_path):
    run_dir, (result,) = course.run(["00"], ci=True, root=tmp_path, notebook_dir=toy_course, stream=False)
    assert result.status == "ok" and result.parameters == {"x": 5}
    executed = nbformat.read(run_dir / "00_ok.ipynb", as_version=4)
    assert "double 10" in "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))


@pytest.mark.parametrize("path", course.find_notebooks(None), ids=lambda p: p.stem)
def test_every_parameter_of_every_notebook_is_found_with_its_default(path):
    """papermill's inspector dropped 11's use_spark (a comment with parentheses) and glued the
    widget call onto each notebook's last default; `-p use_spark=False` was refused as undeclared."""
    import ast
    import re

    params = course.notebook_parameters(path)
    cell = next("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
    widgets = re.search(r"apply_databricks_widgets\(globals\(\), \[(.*?)\]\)", cell, flags=re.S).group(1)
    assert sorted(params) == sorted(re.findall(r'"(\w+)"', widgets))
    for default in params.values():
        ast.literal_eval(default)  # a plain value, nothing glued on


@pytest.mark.slow
def test_stop_leftovers_waits_for_processes_that_are_exiting_and_stops_the_rest():
    import subprocess
    import sys
    import time

    env = {**os.environ, "DTLAB_RUN_ID": "leftover-test"}
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"], env=env)
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    start = time.monotonic()
    left = course.stop_leftovers("leftover-test", grace=3.0)
    assert time.monotonic() - start >= 3.0
    assert len(left) == 1 and "sleep(60)" in left[0]          # the one that was exiting is not reported
    assert stuck.wait(timeout=5) != 0 and exiting.wait(timeout=5) == 0


def test_the_first_lessons_need_no_build_and_horovods_and_deepspeeds_lessons_are_found():
    found = {p.stem[:2]: course.needed_builds(p) for p in course.find_notebooks()}
    assert all(found[n] == [] for n in ("00", "01", "02", "03", "04"))
    assert found["05"] == ["horovod"] and found["06"] == ["deepspeed"] and "deepspeed" in found["21"]


def test_a_lesson_that_imports_a_missing_package_gets_it_built_once_first(tmp_path, monkeypatch, capsys):
    """A real script builds a real (tiny) package into a folder on sys.path; the second call finds it."""
    name = "dtlab_built_here_probe"
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(site))                 # where the lessons' Python finds what was built
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "build_probe.sh").write_text(f"echo \"BUILT_BY = '$1'\" > \"{site}/{name}.py\"\n")
    nb = new_notebook(cells=[new_code_cell("def worker():\n    import dtlab_built_here_probe\n")])
    path = tmp_path / "05_probe.ipynb"
    nbformat.write(nb, path)
    builds = {name: "build_probe.sh"}
    assert course.needed_builds(path, builds) == [name]
    python = sys.executable
    assert not course.is_built(name, python)
    assert course.ensure_built(path, python, builds, tmp_path / "scripts") == [name]
    assert (site / f"{name}.py").read_text() == f"BUILT_BY = '{python}'\n"
    assert "05_probe is the first lesson here that needs" in capsys.readouterr().out
    assert course.ensure_built(path, python, builds, tmp_path / "scripts") == []     # built: nothing to do


@pytest.mark.slow   # 3.5 s or more warm (make test-quick --durations, 2026-12-07)
def test_deepspeeds_python_package_alone_is_not_built_its_ops_are():
    """requirements.txt installs DeepSpeed's package; only the build script compiles its ops in (make test builds
    them, so here they are): the check reads the ops, not the import."""
    assert course.is_built("deepspeed") and course.is_built("horovod")
    assert "installed_ops" in course.BUILT_CHECK["deepspeed"] and "horovod.torch" in course.BUILT_CHECK["horovod"]
