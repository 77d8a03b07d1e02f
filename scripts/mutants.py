"""Grade every mutant of the exercises' references and print the kill rates as a markdown table.

    python scripts/mutants.py [exercise ...]      (default: every exercise; `make mutants`)

A mutant is a reference with one small wrong edit (tests/mutants.py makes them); the grader must fail ("kill")
each one that changes the result, the traffic or the memory. The table gives, per exercise: the mutants, those
killed, those that passed and are argued equivalent in tests/mutants.py's KNOWN_EQUIVALENT, the survivors (they
passed and nobody argued why they may: a weakness of the grader), the kill rate killed / (mutants - equivalent),
the seconds it took, the mutants of GPU-only code that passed on a machine without a GPU (NEEDS_GPU: left out
of the kill rate there) and the edits that do not even build (not run, not counted). Then each survivor, with
its id and what it changed. Progress goes to stderr; the exit status is 1 when a mutant survived.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))   # tests/mutants.py, not this file

import mutants  # noqa: E402

from dtlab.exercises import EXERCISES  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exercises", nargs="*", help=f"exercises to mutate (default: all of {', '.join(EXERCISES)})")
    parser.add_argument("--limit-s", type=float, default=mutants.LIMIT_S,
                        help="seconds a blocking call may wait before the grader stops the run (default %(default)s)")
    parser.add_argument("--sample", type=int, default=0, help="grade only this many mutants per exercise (0: all)")
    parser.add_argument("--verbose", action="store_true", help="list every mutant's outcome, not only survivors")
    args = parser.parse_args()
    names = args.exercises or list(EXERCISES)
    rows, survivors, notes = [], [], []
    for name in names:
        start = time.monotonic()
        found = mutants.mutants(name)
        chosen = mutants.sample(found, args.sample) if args.sample else found
        counts = {"killed": 0, "equivalent": 0, "needs GPU": 0, "survived": 0, "invalid": 0}
        for k, mutant in enumerate(chosen, 1):
            outcome = mutants.grade(mutant, limit_s=args.limit_s)
            argued = mutants.equivalent(mutant)
            status = outcome.status
            if status == "survived" and argued:
                status = "equivalent"
            elif status == "survived" and mutants.needs_gpu(mutant):
                status = "needs GPU"
            counts[status] += 1
            print(f"{name} {k}/{len(chosen)} {status:10s} {outcome.seconds:5.1f} s  {mutant.id}", file=sys.stderr,
                  flush=True)
            if status == "survived":
                survivors.append((name, mutant))
            if status == "needs GPU":
                notes.append(f"{name}: `{mutant.id}` passed here, without a GPU; on one it must fail: "
                             f"{mutants.needs_gpu(mutant)}")
            if argued and outcome.status == "killed":
                notes.append(f"{name}: `{mutant.id}` is argued equivalent but was killed ({outcome.detail[:120]})")
            if args.verbose:
                notes.append(f"{name} {status}: `{mutant.id}` ({outcome.detail[:160]})")
        valid = len(chosen) - counts["invalid"]
        counted = valid - counts["equivalent"] - counts["needs GPU"]
        rate = f"{100 * counts['killed'] / counted:.0f}%" if counted else "-"
        rows.append(f"| {name} | {valid} | {counts['killed']} | {counts['equivalent']} | {counts['survived']} | "
                    f"{rate} | {time.monotonic() - start:.0f} | {counts['needs GPU']} | {counts['invalid']} |")
    print("| exercise | mutants | killed | equivalent (argued) | survivors | kill rate | seconds "
          "| GPU-only, passed here | invalid (not run) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print()
    if survivors:
        print("Survivors (passed the grader, not argued equivalent):\n")
        for name, mutant in survivors:
            print(f"- {name} `{mutant.id}`: {mutant.description}")
    else:
        print("No survivors.")
    for note in notes:
        print(f"- {note}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
