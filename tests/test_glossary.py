"""The reading path: a glossary the lessons link to at each term's first use, lesson cells short enough to read
between a table, a picture or a code cell, and an outline for the lesson with the most topics. The glossary is
``notebooks/glossary.ipynb`` (Markdown only, beside the lessons, so JupyterLab and Databricks open it as they open a
lesson); the website builds a page from it (``dtlab.tooling.website``)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dtlab.tooling import website

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))   # course order
GLOSSARY = ROOT / "notebooks" / website.GLOSSARY

#: Every glossary entry (its anchor) and what counts as a use of its term in a lesson's prose. Upper-case names
#: (acronyms, class and library names) match only as written; the others in any case.
TERMS = {
    "Activation-recomputation": r"\b(?:activation )?recomputation\b",
    "All-gather": r"\ball-gather(?:s|ed|ing)?\b",
    "All-reduce": r"\ball-reduc(?:e|es|ed|ing)\b",
    "Backend": r"\bbackends?\b",
    "bf16": r"\bbf16\b|\bbfloat16\b",
    "Collective": r"\bcollectives?\b",
    "CommDebugMode": r"\bCommDebugMode\b",
    "Context-parallelism": r"\bcontext parallel(?:ism)?\b",
    "DeepSpeed": r"\bDeepSpeed\b",
    "Device-mesh": r"\bdevice mesh(?:es)?\b|\bDeviceMesh\b",
    "DTensor": r"\bDTensors?\b",
    "Expert-parallelism": r"\bexpert parallel(?:ism)?\b",
    "Exposed-communication": r"\bexposed communication\b",
    "fp16": r"\bfp16\b|\bfloat16\b",
    "FSDP": r"\bFSDP2?\b",
    "Gradient-accumulation": r"\bgradient accumulation\b",
    "HFU": r"\bHFU\b",
    "Horovod": r"\bHorovod\b",
    "Loss-scaling": r"\bloss scaling\b|\bGradScaler\b",
    "MFU": r"\bMFU\b",
    "Micro-batch": r"\bmicro-?batch(?:es)?\b",
    "Mixed-precision": r"\bmixed[- ]precision\b",
    "NIC": r"\bNICs?\b",
    "Pipeline-bubble": r"\bbubbles?\b",
    "Pipeline-parallelism": r"\bpipeline parallel(?:ism)?\b",
    "Process-group": r"\bprocess groups?\b",
    "Rank": r"\branks?\b",
    "Reduce-scatter": r"\breduce-scatter(?:s|ed|ing)?\b",
    "Sharded-checkpoint": r"\bsharded checkpoints?\b|\bDCP\b",
    "Spark-Connect": r"\bSpark Connect\b",
    "Tensor-parallelism": r"\btensor parallel(?:ism)?\b",
    "TorchDistributor": r"\bTorchDistributor\b",
    "torchtitan": r"\btorchtitan\b",
    "World-size": r"\bworld size\b",
    "ZeRO": r"\bZeRO\b",
}
CASE_SENSITIVE = {"CommDebugMode", "DeepSpeed", "DTensor", "HFU", "Horovod", "MFU", "NIC", "Spark-Connect",
                  "TorchDistributor", "ZeRO"}
MAX_PROSE_WORDS = 150


def _pattern(anchor):
    return re.compile(TERMS[anchor], 0 if anchor in CASE_SENSITIVE else re.IGNORECASE)


def _markdown_cells():
    """(lesson, cell index, text) of every lesson's Markdown cells, in course order."""
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                yield path.stem, i, "".join(cell["source"])


def prose(text):
    """``text`` with what is not prose blanked, each character kept in place: fenced code, headings, inline code
    (except a lone name such as `DTensor`), link targets, HTML tags."""
    out, fence = [], False
    for line in text.splitlines(keepends=True):
        if line.strip().startswith(("```", "~~~")):
            fence = not fence
            out.append(re.sub(r"[^\n]", " ", line))
        elif fence or line.lstrip().startswith("#"):
            out.append(re.sub(r"[^\n]", " ", line))
        else:
            out.append(line)
    text = "".join(out)
    blank = lambda m: re.sub(r"[^\n]", " ", m.group())  # noqa: E731
    text = re.sub(r"`[^`\n]*`", lambda m: m.group() if re.fullmatch(r"`[A-Za-z][\w-]*`", m.group()) else blank(m),
                  text)
    text = re.sub(r"\]\([^)\s]*\)", lambda m: "]" + " " * (len(m.group()) - 1), text)
    return re.sub(r"<[^>\n]*>", blank, text)


def first_use(anchor, cells=None):
    """Where a term is first used in the lessons' prose: (lesson, cell, text, match) or None."""
    for lesson, i, text in cells if cells is not None else _markdown_cells():
        m = _pattern(anchor).search(prose(text))
        if m:
            return lesson, i, text, m
    return None


def is_glossary_link(text, m, anchor):
    """Whether the match ``m`` lies inside the text of a link to the glossary entry ``anchor``."""
    return any(link.start(1) <= m.start() and m.end() <= link.end(1) and link.group(2) == anchor
               for link in re.finditer(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(glossary\.ipynb#([^)\s]+)\)", text))


def prose_words(text):
    """Words of prose in a Markdown cell: Markdown tables and fenced code are not prose (lists are)."""
    kept, fence = [], False
    for line in text.splitlines():
        if line.strip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence and not line.lstrip().startswith("|"):
            kept.append(line)
    return sum(bool(re.search(r"\w", word)) for word in "\n".join(kept).split())


def test_every_term_has_one_entry_in_the_glossary():
    entries = website.glossary_entries(GLOSSARY)
    assert sorted(entries) == sorted(TERMS), "a term without an entry, or an entry without a term here"
    headings = [website.heading_anchor(t.splitlines()[0]).lower() for t in entries.values()]
    assert headings == sorted(headings), "entries are in alphabetical order"


@pytest.mark.parametrize("anchor", sorted(TERMS))
def test_each_entry_defines_its_term_and_names_the_lesson_of_its_first_use(anchor):
    entry = website.glossary_entries(GLOSSARY)[anchor]
    body = entry.split("\n", 1)[1]
    assert len(re.findall(r"\S+", body)) >= 15 and "." in body, f"{anchor}: a definition in plain sentences"
    first = first_use(anchor)
    assert first, f"no lesson uses {anchor}: link it where a lesson first needs it, or drop the entry"
    assert re.search(rf"First\s+met\s+in\s+\[{first[0]}\]\({first[0]}\.ipynb\)", entry), \
        f"{anchor}: its first use is in {first[0]} (cell {first[1]})"


@pytest.mark.parametrize("anchor", sorted(TERMS))
def test_each_terms_first_use_in_course_order_links_to_its_glossary_entry(anchor):
    lesson, i, text, m = first_use(anchor)
    assert is_glossary_link(text, m, anchor), \
        f"{lesson} cell {i} first uses '{m.group()}': link it, [{m.group()}](glossary.ipynb#{anchor})"


def test_every_glossary_link_in_a_lesson_points_to_an_entry():
    entries = website.glossary_entries(GLOSSARY)
    bad = [f"{lesson} cell {i}: #{a}" for lesson, i, text in _markdown_cells()
           for a in website.GLOSSARY_LINK.findall(text) if a not in entries]
    assert not bad, "links to glossary entries that do not exist:\n" + "\n".join(bad)


def test_the_check_finds_a_first_use_that_is_not_linked():
    cells = [("00_x", 0, "Each rank joins. A [rank](glossary.ipynb#Rank) is a number."),
             ("01_y", 0, "Each [rank](glossary.ipynb#Rank) joins; a rank is a number.")]
    assert not is_glossary_link(*first_use("Rank", cells)[2:], "Rank")
    assert is_glossary_link(*first_use("Rank", cells[1:])[2:], "Rank")
    assert not is_glossary_link(*first_use("Rank", [("01_y", 0, "[rank](glossary.ipynb#World-size)")])[2:], "Rank")
    assert first_use("Rank", [("0", 0, "# Ranks\n`x = rank`, then a [rank](glossary.ipynb#Rank)")])[3].start() > 20


def test_every_lesson_markdown_cell_is_at_most_150_words_of_prose():
    """A Build-it statement stays one cell before its exercises (the grader's cases in a table); any other cell is
    split at a natural break, or its enumeration made a table."""
    long = [f"{lesson} cell {i}: {n} words" for lesson, i, text in _markdown_cells()
            if (n := prose_words(text)) > MAX_PROSE_WORDS]
    assert not long, (f"split these at a natural break, or make an enumeration a table (at most {MAX_PROSE_WORDS} "
                      "words of prose without a table, a picture or code between):\n" + "\n".join(long))


def test_prose_words_count_prose_and_lists_but_not_tables_or_code():
    text = "Two words.\n\n| a | b |\n|---|---|\n| c d e | f |\n\n```python\nx = 1\n```\n- a list item"
    assert prose_words(text) == 5


def test_every_link_to_a_section_of_the_same_lesson_finds_its_heading():
    bad = []
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        anchors = {website.heading_anchor(line) for line in text.splitlines() if re.match(r"#{1,6} ", line)}
        bad += [f"{path.stem}: #{a}" for a in website.PAGE_LINK.findall(text) if a not in anchors]
    assert not bad, "links to headings that do not exist (JupyterLab's anchor: the heading, spaces as dashes):\n" \
        + "\n".join(bad)


def test_notebook_12_opens_with_an_outline_linking_each_topic():
    cells = json.loads((ROOT / "notebooks" / "12_fsdp.ipynb").read_text())["cells"]
    first = "".join(cells[0]["source"])
    linked = set(website.PAGE_LINK.findall(first))
    topics = [website.heading_anchor(line) for c in cells if c["cell_type"] == "markdown"
              for line in "".join(c["source"]).splitlines() if re.match(r"#{2,3} ", line)]
    lesson = [t for t in topics if not t.startswith(("Exercises", "Claims"))]
    assert len(lesson) >= 6 and set(lesson) <= linked, f"outline lacks {sorted(set(lesson) - linked)}"


@pytest.mark.slow   # 3.5 s or more warm (make test-quick --durations, 2026-12-07)
def test_the_website_builds_a_glossary_page_that_the_lessons_links_find(tmp_path):
    """Sphinx (the site's own configuration) on the glossary page and one lesson, as ``website.build`` writes them:
    every link from the lesson to the glossary, and to its own sections, lands on an anchor of the built page."""
    lesson_path = ROOT / "notebooks" / "12_fsdp.ipynb"
    nb = json.loads(lesson_path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    assert website._site_links(nb) >= 4
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(website.CONF)
    (src / "12_fsdp.ipynb").write_text(json.dumps(nb))
    (src / "glossary.md").write_text(website._glossary_page(GLOSSARY, {"12_fsdp"}))
    (src / "index.md").write_text("# Home\n\n```{toctree}\n12_fsdp\nglossary\n```\n")
    done = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", str(src), str(tmp_path / "html")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "myst.xref_missing" not in done.stderr and "WARNING" not in done.stderr, done.stderr[-3000:]
    glossary = (tmp_path / "html" / "glossary.html").read_text()
    page = (tmp_path / "html" / "12_fsdp.html").read_text()
    ids = set(re.findall(r'\bid="([^"]+)"', glossary))
    assert {website.site_anchor(a) for a in TERMS} <= ids
    targets = re.findall(r'href="glossary\.html#([^"]+)"', page)
    assert targets and set(targets) <= ids
    own = set(re.findall(r'\bid="([^"]+)"', page))
    sections = set(re.findall(r'href="#([^"]+)"', page)) - {"main-content"}
    assert len(sections) >= 6 and sections <= own, sorted(sections - own)
    assert "01_single_device_baseline.ipynb" not in glossary and "01_single_device_baseline" in glossary
