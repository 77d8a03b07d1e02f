#!/usr/bin/env bash
# Where a cold set-up's time goes, side by side in one run: each variant in a fresh venv with empty caches.
#
#   bash benchmarks/setup_time.sh [REQUIREMENTS]   (default: requirements.txt)
#
# pip installing the requirements as pip does by default (compiling every module to bytecode as it goes), against
# uv with its bytecode (scripts/lib.sh's install_requirements: what the set-up does), each with an empty cache; then
# uv again into a second fresh venv with the cache the first filled (a warm machine, a fresh clone). Run it on an
# idle machine; it downloads everything twice. (Building Horovod and DeepSpeed at the same time instead of one after
# the other was measured too, and dropped: 485 s against 436 s on 2 cores, both builds already use both.)
set -euo pipefail
cd "$(dirname "$0")/.."
REQUIREMENTS=${1:-requirements.txt}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
say() { printf '[bench] %s\n' "$*"; }
PY=  # set per variant; lib.sh's functions use it
# shellcheck source=scripts/lib.sh
source scripts/lib.sh

fresh_venv() { "$PYTHON" -m venv "$scratch/$1"; PY="$scratch/$1/bin/python"; pip_q install --upgrade pip; }

fresh_venv pip
t=$SECONDS
pip_q install --cache-dir "$scratch/pip-cache" -r "$REQUIREMENTS"
pip_cold=$((SECONDS - t))

# (uv, the wheels of source-only packages and pip, which builds those, all start empty too)
export UV_CACHE_DIR="$scratch/uv-cache" DTLAB_CACHE="$scratch/dtlab-cache" PIP_CACHE_DIR="$scratch/pip-cache-uv"
fresh_venv uv-cold
t=$SECONDS
install_requirements "$REQUIREMENTS"
uv_cold=$((SECONDS - t))

fresh_venv uv-warm
t=$SECONDS
install_requirements "$REQUIREMENTS"
uv_warm=$((SECONDS - t))
say "$REQUIREMENTS: pip ${pip_cold} s (empty cache); uv ${uv_cold} s (empty cache), ${uv_warm} s (its cache filled)"
