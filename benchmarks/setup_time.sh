#!/usr/bin/env bash
# Where a cold set-up's time goes, side by side in one run: each variant in a fresh venv with empty caches.
#
#   bash benchmarks/setup_time.sh [REQUIREMENTS]   (default: requirements.txt)
#
# pip installing the requirements as pip does by default (compiling every module to bytecode, one file
# after another) against --no-compile followed by `compileall -j 0` (the same .pyc files, on all cores:
# scripts/lib.sh's install_requirements). Run it on an idle machine; it takes about 7 minutes on 2 cores
# and leaves nothing behind. (Building Horovod and DeepSpeed at the same time instead of one after the
# other was measured too, and dropped: 485 s against 436 s on 2 cores, both builds already use both.)
set -euo pipefail
cd "$(dirname "$0")/.."
REQUIREMENTS=${1:-requirements.txt}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
say() { printf '[bench] %s\n' "$*"; }
PY=  # set per variant; lib.sh's pip_q uses it
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

fresh_venv() { "$PYTHON" -m venv "$scratch/$1"; PY="$scratch/$1/bin/python"; pip_q install --upgrade pip; }

fresh_venv compiled
t=$SECONDS
pip_q install --cache-dir "$scratch/pip-cache-1" -r "$REQUIREMENTS"
compiled=$((SECONDS - t))

fresh_venv parallel
t=$SECONDS
install_requirements "$REQUIREMENTS" --cache-dir "$scratch/pip-cache-2"
parallel=$((SECONDS - t))
say "pip install: ${compiled} s compiling as it goes, ${parallel} s with --no-compile + compileall -j 0"

