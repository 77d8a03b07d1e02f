"""How often does each claim of the course hold? Re-run the notebooks whose claims rest on timings.

    .venv/bin/python benchmarks/claim_stability.py [--rounds 20] [--notebooks 01 02 03 04 05 08 10] [--alt] [--edge]
        [--table F]

Each round runs the chosen notebooks with their CI parameters (as the tests do) into a fresh
folder, one after another, and reads the claims each notebook recorded (``dtlab.notebook.Claims``
writes ``<notebook>.claims.json``). For every claim it prints how many rounds it held in, and the
spread (min / median / max) of the measured values it rests on. A notebook that failed before its
claims cell counts as a failure of all its claims (named in the table). ``--alt`` adds each notebook's
second parameter set (the one the runtime's job uses), ``--edge`` its edge set (the most processes it allows, degrees
of 1), each as a row of its own. Run it on an idle machine:
its purpose is to show that a claim holds run after run, not only once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from dtlab.tooling import runner as course

TIMING_NOTEBOOKS = ["01", "02", "03", "04", "05", "08", "10", "15"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--notebooks", nargs="*", default=TIMING_NOTEBOOKS)
    ap.add_argument("--alt", action="store_true", help="add the notebooks' second parameter sets")
    ap.add_argument("--edge", action="store_true", help="add the notebooks' edge parameter sets")
    ap.add_argument("--table", help="also write the table so far to this file after every round")
    args = ap.parse_args()
    notebooks = course.resolve(args.notebooks, course.find_notebooks())
    held: dict[tuple[str, str], list[bool]] = defaultdict(list)
    values: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    failures: dict[str, list[str]] = defaultdict(list)
    start = time.monotonic()
    sets = ["ci"] + (["alt"] if args.alt else []) + (["edge"] if args.edge else [])
    for rnd in range(args.rounds):
        for which in sets:
            for nb in notebooks:
                params = course.edge_parameters(nb) if which == "edge" else None
                with tempfile.TemporaryDirectory(prefix="claims-") as folder:
                    result = course.run_one(nb, Path(folder), params=params, ci=True, alt=which == "alt",
                                            stream=False)
                    path = Path(folder) / f"{nb.stem}.claims.json"
                    claims = json.loads(path.read_text()) if path.exists() else None
                name = nb.stem if which == "ci" else f"{nb.stem} ({which}: {result.parameters.get('nprocs')} procs)"
                if claims is None:
                    failures[name].append(f"round {rnd + 1}: cell {result.failing_cell}: {result.error}")
                    for key in [k for k in held if k[0] == name]:
                        held[key].append(False)
                    continue
                for claim in claims:
                    key = (name, claim["claim"])
                    held[key].append(claim["holds"])
                    for quantity, value in claim["measured"].items():
                        if isinstance(value, (int, float)) and not isinstance(value, bool):
                            values[key][quantity].append(float(value))
        print(f"round {rnd + 1}/{args.rounds} done ({time.monotonic() - start:.0f} s)", flush=True)
        if args.table:  # the table so far, so a run stopped early still says what it saw
            Path(args.table).write_text(_table(rnd + 1, notebooks, held, values, failures, start,
                                               args.alt or args.edge))
    print(_table(args.rounds, notebooks, held, values, failures, start, args.alt or args.edge))


def _table(rounds, notebooks, held, values, failures, start, alt=False) -> str:
    which = "CI parameters, and each second or edge set asked for" if alt else "CI parameters"
    lines = [f"{rounds} rounds of {', '.join(nb.stem for nb in notebooks)} with {which}, "
             f"{time.monotonic() - start:.0f} s", "",
             "| notebook | claim | held | measured values: min / median / max |", "|---|---|---:|---|"]
    for (nb, claim), results in held.items():
        spreads = "; ".join(f"{name} {min(v):.3g} / {statistics.median(v):.3g} / {max(v):.3g}"
                            for name, v in values[(nb, claim)].items())
        lines.append(f"| {nb[:2]}{nb[len(nb.split(' ')[0]):]} | {claim} | {sum(results)}/{len(results)} | {spreads} |")
    for nb, problems in failures.items():
        lines += ["", f"{nb} failed before its claims in {len(problems)} round(s):", *(f"  {p}" for p in problems)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
