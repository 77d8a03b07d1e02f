"""Rewrite the README's tables that the tests hold to the planner (``tests/test_published_runs.py``,
``tests/test_planner_memory.py``): run after a change to the planner or to its records.

    python scripts/readme_tables.py
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def replace_table(text: str, header: str, table: str) -> str:
    """``text`` with the Markdown table that starts with the line ``header`` replaced by ``table``."""
    start = text.index(header)
    end = start
    lines = text[start:].split("\n")
    n = next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))
    end = start + len("\n".join(lines[:n]))
    return text[:start] + table + text[end:]


def main() -> None:
    from dtlab.planner import memory_record, published

    text = README.read_text()
    for table in (published.format_sources(), published.format_sources(by="framework"), published.format_benchmarks(),
                  published.format_table(),
                  memory_record.format_sources()):
        text = replace_table(text, table.split("\n")[0], table)
    README.write_text(text)
    print("README.md: tables rewritten" if re.search(r"\| run \| layout priced \|", text) else "no table found")


if __name__ == "__main__":
    main()
