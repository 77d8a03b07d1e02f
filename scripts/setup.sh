#!/usr/bin/env bash
# Set up everything the course needs, idempotently: .venv with requirements.txt and dtlab,
# Horovod (built once, cached), DeepSpeed's CPU ops (compiled once, cached), a Jupyter kernel.
# Called by `make setup`, and so by `make course` and `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
say() { printf '[setup] %s\n' "$*"; }
# pip, quiet, minus one harmless warning some machines' pip config prints for every package.
pip_q() { "$PY" -m pip --quiet --disable-pip-version-check "$@" 2>&1 \
            | sed '/is neither a file nor a directory/d'; }
start=$SECONDS

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# Reinstall only when what we install from changed.
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -c1-16)
stamp="$VENV/.dtlab-requirements"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing requirements.txt and dtlab into $VENV (first time: a few minutes)"
  t=$SECONDS
  pip_q install --upgrade pip
  pip_q install -r requirements.txt
  pip_q install --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
  say "packages installed in $((SECONDS - t)) s"
else
  say "packages up to date ($VENV)"
fi

bash scripts/build_horovod.sh "$PY"
"$PY" scripts/prebuild_deepspeed_ops.py

if [ ! -f "$VENV/share/jupyter/kernels/python3/kernel.json" ]; then
  say "registering the Jupyter kernel 'python3' in $VENV"
  "$PY" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (dtlab)" >/dev/null
fi
say "ready in $((SECONDS - start)) s"
