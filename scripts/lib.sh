# Shared by the set-up scripts: quiet pip, and the wheel cache outside the repo.
# shellcheck shell=bash

# pip, quiet, minus one harmless warning some machines' pip config prints for every package.
pip_q() { "$PY" -m pip --quiet --disable-pip-version-check "$@" 2>&1 \
            | sed '/is neither a file nor a directory/d'; }

# Wheels built here depend on the Python and torch they were built against: cache them per pair,
# outside the repo, so fresh clones and new venvs on this machine reuse them.
wheel_cache() {
  local key
  key=$("$PY" -c "import sys, torch; print(f'py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}')")
  echo "${DTLAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtlab}/wheels/$key"
}
