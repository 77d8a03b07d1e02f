"""The course website: built from a small real run (notebook 14, which has a plot and claims, and notebook
00 made to fail), every page opened in headless Chromium, and the checker shown catching each fault."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dtlab.tooling import runner as course
from dtlab.tooling import website

pytestmark = pytest.mark.slow  # every test here starts a cluster, a browser, a set-up or several launches


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    run_dir, results = course.run(["14"], ci=True, root=root, stream=False)
    failed = course.run_one(REPO / "notebooks" / "00_environment.ipynb", run_dir, {"nprocs": -1}, ci=True,
                            stream=False)
    assert results[0].status == "ok" and failed.status == "failed"
    course.write_summary(run_dir, results + [failed])
    return run_dir


@pytest.fixture(scope="module")
def site(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "site"
    return website.build(run_dir, out, readme=REPO / "README.md", work=out.parent / "source")


def test_every_page_opens_in_chromium_with_its_plots_and_links(site, run_dir):
    report = website.check(site)
    assert report.ok, "\n".join(report.problems)
    assert report.pages == 6  # home, two notebooks, API, search, index
    assert report.plots >= 1 and report.links > 50
    assert report.folded >= 1                                  # notebook 14's claims cell, behind a toggle
    assert report.search_results >= 3  # home, API, the notebooks that name dtlab
    assert sorted(Path(p).name for p in report.screenshots) == ["site-home.png", "site-notebook.png"]
    for shot in report.screenshots:
        assert Path(shot).parent == run_dir and Path(shot).read_bytes()[:4] == b"\x89PNG"


def test_a_notebook_page_says_how_it_was_produced_and_lists_its_claims(site, run_dir):
    page = (site / "14_tensor_parallelism.html").read_text()
    claims = json.loads((run_dir / "14_tensor_parallelism.claims.json").read_text())
    env = json.loads((run_dir / "environment.json").read_text())
    assert "How this page was produced" in page and f"{env['cpu_cores']} CPU cores" in page
    assert f"torch {env['torch']}" in page
    assert f"{len(claims)} of {len(claims)} hold" in page
    text = _plain(page)
    for c in claims:
        assert _plain(c["claim"]) in text, c["claim"]


def _plain(html_text):
    """Text as the page shows it: entities unescaped, Sphinx's smart quotes and dashes made plain."""
    import html

    table = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "--",
                           "\u2014": "---", "\u2026": "..."})
    return html.unescape(html_text).translate(table)


def test_a_failed_notebook_is_published_with_its_failure_first(site):
    page = (site / "00_environment.html").read_text()
    assert "This notebook FAILED in this run at cell" in page and "nprocs=-1 must be a positive integer" in page
    assert page.index("FAILED in this run") < page.index("What you will learn")
    home = (site / "index.html").read_text()
    assert "failed: 00_environment" in home
    assert "01_single_device_baseline (not in this run)" in home  # the map keeps every lesson


def test_the_build_writes_nothing_beside_the_site(site):
    assert sorted(p.name for p in site.parent.iterdir()) == ["site", "source"]  # no jupyter_execute/


def test_the_api_reference_has_every_public_module(site):
    page = (site / "api.html").read_text()
    for module in ("dtlab.launch", "dtlab.parallel.fsdp", "dtlab.tooling.website", "dtlab.advise"):
        assert module in page
    assert "dtlab.tooling.website.build" in page and "Build the website of" in page


def test_the_check_catches_each_fault(site, tmp_path):
    broken = shutil.copytree(site, tmp_path / "broken")
    (broken / "api.html").unlink()  # a missing page, and every link to it broken
    (broken / "searchindex.js").write_text("Search.setIndex({})")  # a search that finds nothing
    for png in (broken / "_images").glob("*.png"):  # plots that do not load
        png.unlink()
    lesson = broken / "14_tensor_parallelism.html"              # its claims cell unfolded
    lesson.write_text(re.sub(r"<details([^>]*)>", r"<details\1 open>", lesson.read_text()))
    home = broken / "index.html"
    home.write_text(home.read_text().replace(
        "</body>", '<a href="nowhere.html">x</a><script src="https://cdn.example.com/x.js"></script>'
                   '<script>console.error("boom")</script></body>'))
    report = website.check(broken, screenshots=tmp_path)
    text = "\n".join(report.problems)
    assert "api.html: page missing" in text
    assert "index.html: broken link to nowhere.html" in text
    assert "14_tensor_parallelism.html: 0 plots shown, its notebook has" in text
    assert "requested https://cdn.example.com/x.js" in text
    assert "console error: boom" in text
    assert "searching for 'dtlab' found nothing" in text
    assert "14_tensor_parallelism.html: 0 cells folded behind a toggle" in text
    assert "14_tensor_parallelism.html: its claims cell's source is shown" in text


def test_bad_input_names_the_fix(tmp_path):
    with pytest.raises(website.SiteError, match="no summary.json.*make course"):
        website.build(tmp_path, tmp_path / "site")
    with pytest.raises(website.SiteError, match="make site"):
        website.check(tmp_path)
    assert website.newest_run(tmp_path) is None


def test_no_run_and_no_way_to_run_the_course_says_so(tmp_path):
    # The Python that made .venv has neither papermill nor the course's kernel: `dtlab site` there.
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    has = subprocess.run([base, "-c", "import papermill"], capture_output=True).returncode == 0
    if has:
        pytest.skip(f"{base} has papermill: no Python without it here")
    done = subprocess.run([base, "-c", "import sys; from dtlab.tooling.cli import main; sys.exit(main(sys.argv[1:]))",
                           "site", "--runs", str(tmp_path)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "cannot run here: papermill is not installed" in done.stderr and "make setup" in done.stderr
