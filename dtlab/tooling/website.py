"""The executed course as a static website, and a check of it in a real browser.

``build(run_dir)`` turns a course run (``runs/<timestamp>/``: executed notebooks, ``summary.json``,
each notebook's ``claims.json``, ``environment.json``) into a website in ``site/`` with Sphinx,
MyST-NB and the Sphinx Book Theme: a home page with the course map, one page per notebook in
course order with its outputs and plots, a header on each saying how that page was produced
(parameters, machine, date, status) and its claims with their measured values, the course's glossary
(``notebooks/glossary.ipynb``, one entry per term, which the lessons link to), and the ``dtlab``
API reference from its docstrings. A notebook that failed is published with its failure at the top.
Everything the pages load comes from the installed packages: the site builds and reads offline,
from the file system or any static server.

``check(site_dir)`` opens every page in headless Chromium and reports what is wrong: a missing page,
a broken internal link, a notebook page without its plots, a console error, a request that leaves
the site. ``make site`` does both; ``dtlab site build`` / ``dtlab site check`` do one each.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM = os.environ.get("DTLAB_CHROMIUM", "/usr/bin/chromium")
# Without the background-networking flags Chromium keeps calling Google's hosts, which a closed
# network refuses (and reports as errors).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MANIFEST = "_dtlab_pages.json"


class SiteError(RuntimeError):
    """The site cannot be built or checked; the message says how to fix it."""


def newest_run(root: str | os.PathLike = "runs") -> Path | None:
    """The newest run folder under ``root`` that finished (it has ``summary.json``), or None."""
    runs = sorted(p.parent for p in Path(root).glob("*/summary.json"))
    return runs[-1] if runs else None


def _require(module: str, what: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise SiteError(f"{what} ({module}) is not installed in {sys.executable}. Fix: `make setup` "
                        f"(it installs requirements.txt into .venv), then `make site`.")


def course_cannot_run() -> str | None:
    """Why this Python cannot run the course headless (papermill or the course's kernel missing), or None."""
    import importlib.util

    if importlib.util.find_spec("papermill") is None:
        return f"papermill is not installed in {sys.executable}"
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        return "no Jupyter kernel 'python3' is registered"
    return None


def _run_time(run_dir: Path) -> str:
    try:
        stamp = time.strptime(run_dir.name[:15], "%Y%m%d-%H%M%S")
        return time.strftime("%Y-%m-%d %H:%M", stamp)
    except ValueError:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime((run_dir / "summary.json").stat().st_mtime))


def _machine(env: dict[str, Any] | None) -> str:
    if not env:
        return "not recorded (a run made before `dtlab course run` wrote environment.json)"
    plan = env.get("plan", {})
    gpus = ", ".join(env.get("gpus") or []) or "no GPU"
    libs = ", ".join(f"{k} {v}" for k, v in (env.get("packages") or {}).items() if v)
    return (f"{env.get('cpu_cores')} CPU cores, {gpus}; backend {plan.get('backend')} on {plan.get('device')}, "
            f"{plan.get('nprocs')} processes; Python {env.get('python')}, torch {env.get('torch')}, {libs}")


def _cell(text: str) -> dict[str, Any]:
    return {"cell_type": "markdown", "metadata": {}, "source": text}


def _header(result: dict[str, Any], claims: list[dict[str, Any]] | None, machine: str, when: str) -> str:
    params = ", ".join(f"`{k}={v!r}`" for k, v in sorted(result.get("parameters", {}).items())) or "the defaults"
    lines = []
    if result["status"] != "ok":
        cell = result.get("failing_cell")
        lines += [":::{error} This notebook FAILED in this run" + (f" at cell {cell}" if cell is not None else ""),
                  f"`{(result.get('error') or 'no error recorded').splitlines()[0][:500]}`",
                  "", "The outputs below stop where it failed; its claims were not all checked.", ":::", ""]
    lines += [":::{admonition} How this page was produced", ":class: note",
              f"**Run** {when}, {result['status']} in {result['seconds']:.0f} s · **parameters** {params}  ",
              f"**Machine** {machine}", ":::", ""]
    if claims:
        held = sum(c["holds"] for c in claims)
        lines += [f"**Claims** ({held} of {len(claims)} hold; asserted in the last cell):", "",
                  "| claim | holds | measured |", "|---|---|---|"]
        for c in claims:
            measured = ", ".join(f"{k} = {v}" for k, v in c["measured"].items()).replace("|", "\\|")
            lines.append(f"| {c['claim'].replace('|', chr(92) + '|')} | {'yes' if c['holds'] else '**NO**'} | "
                         f"{measured[:300]} |")
    elif result["status"] == "ok":
        lines.append("This run recorded no claims for this notebook.")
    return "\n".join(lines) + "\n"


def _plots(nb: dict[str, Any]) -> int:
    return sum("image/png" in out.get("data", {}) for c in nb["cells"] if c["cell_type"] == "code"
               for out in c.get("outputs", []))


def _course_map(readme: Path, published: set[str]) -> str:
    """The README's notebook table, each row linked to its page when this run has it."""
    rows = [line for line in readme.read_text().splitlines() if re.match(r"\| \d\d \| `\d\d_\w+` \|", line)]
    out = ["| # | notebook | what it teaches and measures |", "|---|---|---|"]
    for row in rows:
        number, name, rest = re.match(r"\| (\d\d) \| `(\w+)` \| (.*)", row).groups()
        link = f"[{name}]({name}.ipynb)" if name in published else f"{name} (not in this run)"
        out.append(f"| {number} | {link} | {rest}")
    return "\n".join(out)


#: Cell tags that fold a cell away on the website behind a toggle: MyST-NB's ``hide-input`` (a code cell's source:
#: every lesson's claims cell carries it) and the course's ``method`` (a markdown cell of measurement-method
#: detail, wrapped here in a ``<details>`` element).
HIDDEN_TAGS = ("hide-input", "method")


def _fold_method_cells(nb: dict[str, Any]) -> int:
    """Wrap each markdown cell tagged ``method`` in a closed ``<details>`` element; return how many cells of ``nb``
    the website shows folded (``HIDDEN_TAGS``)."""
    hidden = 0
    for cell in nb["cells"]:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] == "markdown" and "method" in tags:
            body = "".join(cell["source"])
            cell["source"] = ('<details class="dtlab-method">\n<summary>How this is measured</summary>\n\n'
                              f"{body}\n\n</details>")
        hidden += any(t in tags for t in HIDDEN_TAGS)
    return hidden


#: The glossary: a Markdown-only notebook beside the lessons (so JupyterLab and Databricks open it as they open a
#: lesson), one cell per term, each opening with the term as a ``## `` heading.
GLOSSARY = "glossary.ipynb"
#: A lesson's link to a glossary entry, ``[text](glossary.ipynb#Anchor)``: the anchor is the one JupyterLab gives the
#: entry's heading (``heading_anchor``).
GLOSSARY_LINK = re.compile(r"\]\(glossary\.ipynb#([^)\s]+)\)")
#: A link to a heading of the same notebook, ``[text](#Anchor)`` (JupyterLab's anchors too).
PAGE_LINK = re.compile(r"\]\(#([^)\s]+)\)")


def heading_anchor(heading: str) -> str:
    """The anchor JupyterLab gives a Markdown heading (its text, spaces made dashes): ``## Device mesh`` is
    ``#Device-mesh``. Lessons link to glossary entries and to their own sections with it."""
    return heading.strip().lstrip("#").strip().replace("`", "").replace(" ", "-")


def site_anchor(anchor: str) -> str:
    """The anchor MyST gives the same heading on the website (GitHub's slugs, ``myst_heading_anchors``): lower case,
    spaces made dashes, punctuation other than dashes and underscores dropped."""
    return re.sub(r"[^\w\u4e00-\u9fff\- ]", "", anchor.lower().replace(" ", "-"))


def glossary_entries(path: str | os.PathLike) -> dict[str, str]:
    """The glossary's entries, ``{anchor: entry's Markdown}``, in the glossary's order."""
    nb = json.loads(Path(path).read_text())
    entries = {}
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and text.startswith("## "):
            entries[heading_anchor(text.splitlines()[0])] = text
    return entries


def _glossary_page(path: Path, published: set[str]) -> str:
    """The glossary as a page of the site: every entry under its heading; a link to a lesson this run did not
    publish becomes the lesson's name."""
    def lesson(m: re.Match) -> str:
        return m.group(0) if m.group(2) in published else m.group(1)

    nb = json.loads(path.read_text())
    text = "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    return re.sub(r"\[([^\]]+)\]\(((?:\d\d_\w+))\.ipynb\)", lesson, text) + "\n"


def _site_links(nb: dict[str, Any], glossary: bool = True) -> int:
    """Point a lesson's links at the site's pages: a glossary link to the glossary page's entry (or, when the site has
    no glossary, its text alone), a link to one of its own headings to that heading's anchor on its page. Returns
    how many glossary links it rewrote."""
    count = 0

    def to_glossary(m: re.Match) -> str:
        nonlocal count
        count += 1
        return f"](glossary.md#{site_anchor(m.group(1))})"

    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        if glossary:
            text = GLOSSARY_LINK.sub(to_glossary, text)
        else:
            count += len(GLOSSARY_LINK.findall(text))
            text = re.sub(r"\[([^\]]+)\]\(glossary\.ipynb#[^)\s]+\)", r"\1", text)
        cell["source"] = PAGE_LINK.sub(lambda m: f"](#{site_anchor(m.group(1))})", text)
    return count


def _readme_section(readme: Path, heading: str) -> str:
    """A section of the README; its links to the repository's other Markdown files (not pages of the site)
    become their names, said to be in the repository."""
    text = readme.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    section = text[start + len(heading):end if end > 0 else None].strip()
    return re.sub(r"\[([^\]]+)\]\((?!https?:|#)[^)]*\.md(?:#[^)]*)?\)", r"\1 (in the repository)", section)


def _api_page() -> str:
    """Every public module, class and function of dtlab with its signature and docstring, shown as
    plain text (as ``help()`` shows it: the docstrings are written to be read, not as reStructuredText)."""
    import importlib
    import inspect
    import pkgutil

    import dtlab

    def block(doc: str | None) -> list[str]:
        return ["````text", inspect.cleandoc(doc or "(no docstring)"), "````", ""]

    names = sorted(m.name for m in pkgutil.walk_packages(dtlab.__path__, "dtlab.")
                   if not any(part.startswith("_") for part in m.name.split(".")) and ".clusters" not in m.name)
    lines = ["# The `dtlab` API", "", "Generated from the docstrings: `help(dtlab.<module>)` shows the same.", ""]
    for name in names:
        module = importlib.import_module(name)
        lines += [f"## `{name}`", "", *block(module.__doc__)]
        for attr, obj in vars(module).items():
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                signature = ""
            kind = "class " if inspect.isclass(obj) else ""
            lines += [f"### `{name}.{attr}`", "", "```python", f"{kind}{attr}{signature}", "```", "",
                      *block(obj.__doc__)]
    return "\n".join(lines)


CONF = '''\
project = "Distributed training, runnable"
author = "dtlab"
extensions = ["myst_nb"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3             # lessons link to the glossary's entries and to their own sections
nb_execution_mode = "off"            # the run already executed every notebook
nb_merge_streams = True
html_theme = "sphinx_book_theme"
html_title = project
html_theme_options = {"show_toc_level": 2, "use_download_button": False}
html_context = {"default_mode": "light"}
html_show_search_summary = False     # summaries fetch each page, which a browser refuses from file://
html_last_updated_fmt = None
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type", "toc.not_included", "misc.highlighting_failure"]
exclude_patterns = ["_build"]
'''


def build(run_dir: str | os.PathLike, out: str | os.PathLike = "site", readme: str | os.PathLike = "README.md",
          work: str | os.PathLike = "build/site-source", quiet: bool = True,
          glossary: str | os.PathLike | None = None) -> Path:
    """Build the website of ``run_dir`` into ``out`` and return ``out``. ``glossary`` is the glossary notebook
    (default: ``notebooks/glossary.ipynb`` beside ``readme``); without one the lessons' glossary links become text.

    Raises:
        SiteError: the run folder has no ``summary.json``, or Sphinx / MyST-NB is not installed.
    """
    run_dir, out, work, readme = Path(run_dir), Path(out), Path(work), Path(readme)
    glossary = Path(glossary) if glossary else readme.resolve().parent / "notebooks" / GLOSSARY
    if not (run_dir / "summary.json").exists():
        raise SiteError(f"{run_dir} is not a finished course run (no summary.json). Fix: `make course` "
                        "(or `dtlab course run --ci`), then `make site`; or name a folder under runs/.")
    _require("sphinx", "Sphinx")
    _require("myst_nb", "MyST-NB")
    _require("sphinx_book_theme", "the Sphinx Book Theme")
    results = json.loads((run_dir / "summary.json").read_text())
    env_file = run_dir / "environment.json"
    machine = _machine(json.loads(env_file.read_text()) if env_file.exists() else None)
    when = _run_time(run_dir)

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "conf.py").write_text(CONF)
    manifest: dict[str, Any] = {}
    for result in sorted(results, key=lambda r: r["notebook"]):
        name = result["notebook"]
        executed = run_dir / f"{name}.ipynb"
        if not executed.exists():  # it failed before papermill wrote anything: publish the failure alone
            nb = {"cells": [_cell(f"# {name}")], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
        else:
            nb = json.loads(executed.read_text())
        claims_file = run_dir / f"{name}.claims.json"
        claims = json.loads(claims_file.read_text()) if claims_file.exists() else None
        # papermill's own "An Exception was encountered" cells: the header says it, with the cell
        nb["cells"] = [c for c in nb["cells"] if "papermill-error-cell-tag" not in c["metadata"].get("tags", [])]
        header = _cell(_header(result, claims, machine, when))
        first = "".join(nb["cells"][0]["source"]) if nb["cells"] and nb["cells"][0]["cell_type"] == "markdown" else ""
        if first.startswith("# "):  # the header goes right under the notebook's title
            title, _, rest = first.partition("\n")
            nb["cells"][0:1] = [_cell(title), header] + ([_cell(rest)] if rest.strip() else [])
        else:
            nb["cells"].insert(0, header)
        hidden = _fold_method_cells(nb)
        _site_links(nb, glossary=glossary.exists())
        (work / f"{name}.ipynb").write_text(json.dumps(nb))
        manifest[f"{name}.html"] = {"notebook": name, "status": result["status"], "plots": _plots(nb),
                                    "hidden": hidden}
    ok = sum(r["status"] == "ok" for r in results)
    failed = [r["notebook"] for r in results if r["status"] != "ok"]
    index = ["# Distributed training, runnable", "",
             _readme_section(readme, "# Distributed training, runnable").split("\n## ")[0], "",
             f"These pages are the course as it ran on {when}: {ok} of {len(results)} notebooks ran to the end"
             + (f"; **failed: {', '.join(failed)}** (each page says where)." if failed else ".")
             + f" Machine: {machine}.", "",
             "## The course", "", _course_map(readme, set(manifest_name[:-5] for manifest_name in manifest)), "",
             "## Run it yourself", "", _readme_section(readme, "## Start here"), "",
             "## Build it: the graded exercises", "", _readme_section(readme, "## Build it: the graded exercises"), "",
             "The helper package's reference: [the dtlab API](api.md)."
             + (" The course's terms: [the glossary](glossary.md)." if glossary.exists() else ""), "",
             "```{toctree}", ":hidden:", ":caption: Notebooks", "",
             *[n[:-5] for n in manifest], "", "```", "",
             "```{toctree}", ":hidden:", ":caption: Reference", "", "api",
             *(["glossary"] if glossary.exists() else []), "```", ""]
    (work / "index.md").write_text("\n".join(index))
    (work / "api.md").write_text(_api_page())
    if glossary.exists():  # checked through the lessons' links to it (`check` fails a link to a missing anchor)
        (work / "glossary.md").write_text(_glossary_page(glossary, {name[:-5] for name in manifest}))
    manifest["index.html"] = {"notebook": None, "status": "ok", "plots": 0}
    manifest["api.html"] = {"notebook": None, "status": "ok", "plots": 0}

    # Sphinx builds inside `work`: MyST-NB writes a jupyter_execute/ folder beside the HTML folder,
    # which must not land next to `out` (the repository's root for site/).
    html = work / "_build" / "html"
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-j", "2", *(["-q"] if quiet else []), str(work), str(html)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SiteError(f"Sphinx failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(html, out)
    (out / MANIFEST).write_text(json.dumps({"run": str(run_dir.resolve()), "pages": manifest}, indent=1))
    return out


@dataclass
class Check:
    """What ``check`` found: the pages it opened and every problem, each naming its page."""

    pages: int = 0
    links: int = 0
    plots: int = 0
    search_results: int = 0
    folded: int = 0
    problems: list[str] = field(default_factory=list)
    screenshots: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check(site: str | os.PathLike = "site", screenshots: str | os.PathLike | None = None) -> Check:
    """Open every page of a built ``site`` in headless Chromium and return what is wrong.

    Fails a page on: the page missing, an internal link to a file or anchor that does not exist,
    fewer loaded images than its notebook has plots, fewer folded cells (closed ``<details>``: claims and
    method cells) than its notebook tags ``HIDDEN_TAGS``, a claims cell's source shown unfolded, a console error
    or uncaught exception, and any request that is not to a file of the site (the site must work offline);
    and a search that finds nothing. Screenshots of the
    home page and the first notebook page with plots go to ``screenshots`` (default: the run folder).
    """
    from urllib.parse import unquote, urlparse

    site = Path(site).resolve()
    if not (site / MANIFEST).exists():
        raise SiteError(f"{site} is not a built course site (no {MANIFEST}). Fix: `make site`.")
    _require("playwright", "Playwright")
    if not Path(CHROMIUM).exists():
        raise SiteError(f"no Chromium at {CHROMIUM}. Fix: `make setup` installs Debian's chromium "
                        "(apt-get install chromium), or set DTLAB_CHROMIUM to a Chromium binary.")
    from playwright.sync_api import sync_playwright

    manifest = json.loads((site / MANIFEST).read_text())
    shots = Path(screenshots or manifest["run"])
    report = Check()
    anchors: dict[Path, set[str]] = {}

    def ids(html: Path) -> set[str]:
        if html not in anchors:
            anchors[html] = set(re.findall(r'\bid="([^"]+)"', html.read_text()))
        return anchors[html]

    pages = list(manifest["pages"].items()) + [("search.html", {"plots": 0}), ("genindex.html", {"plots": 0})]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        current = {"name": ""}

        def outside(route):
            report.problems.append(f"{current['name']}: requested {route.request.url} (not a file of the site)")
            route.abort()

        page.route(re.compile(r"^(?!file:).*"), outside)
        page.on("console", lambda m: m.type == "error" and report.problems.append(
            f"{current['name']}: console error: {m.text[:300]}"))
        page.on("pageerror", lambda e: report.problems.append(f"{current['name']}: uncaught error: {e}"))
        shot_notebook = None
        for name, info in pages:
            current["name"] = name
            path = site / name
            if not path.exists():
                report.problems.append(f"{name}: page missing")
                continue
            page.goto(path.as_uri(), wait_until="load")
            report.pages += 1
            for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)"):
                url = urlparse(href)
                if url.scheme != "file":
                    continue
                report.links += 1
                target = Path(unquote(url.path))
                shown = target.relative_to(site) if target.is_relative_to(site) else target
                if not target.exists():
                    report.problems.append(f"{name}: broken link to {shown}")
                elif url.fragment and target.suffix == ".html" and unquote(url.fragment) not in ids(target):
                    report.problems.append(f"{name}: link to a missing anchor #{url.fragment} in {shown}")
            images = page.eval_on_selector_all(
                "article img", "els => els.map(e => e.complete && e.naturalWidth > 0)")
            loaded = sum(images)
            report.plots += loaded
            if loaded < info.get("plots", 0):
                report.problems.append(f"{name}: {loaded} plots shown, its notebook has {info['plots']}")
            folded = page.eval_on_selector_all("article details", "els => els.filter(e => !e.open).length")
            report.folded += folded
            if folded < info.get("hidden", 0):
                report.problems.append(f"{name}: {folded} cells folded behind a toggle, its notebook tags "
                                       f"{info['hidden']} (claims and method cells)")
            shown_claims = page.eval_on_selector_all(
                "article pre", "els => els.filter(e => e.innerText.includes('claims.verify()') "
                "&& e.getClientRects().length > 0).length")
            if shown_claims and info.get("notebook"):
                report.problems.append(f"{name}: its claims cell's source is shown, not folded behind a toggle")
            if name == "index.html":
                shot = shots / "site-home.png"
                page.screenshot(path=str(shot))
                report.screenshots.append(str(shot))
            elif shot_notebook is None and info.get("plots"):
                shot_notebook = shots / "site-notebook.png"
                page.screenshot(path=str(shot_notebook))
                report.screenshots.append(str(shot_notebook))
        current["name"] = "search.html?q=dtlab"  # the search index answers, from the file system too
        page.goto((site / "search.html").as_uri() + "?q=dtlab", wait_until="load")
        try:
            page.wait_for_selector("ul.search li", timeout=15_000)
            report.search_results = len(page.query_selector_all("ul.search li"))
        except Exception:  # playwright's TimeoutError
            report.problems.append("search.html: searching for 'dtlab' found nothing")
        browser.close()
    return report
