#!/usr/bin/env bash
# Set up a Databricks Runtime LTS ML Python stack as a test target, idempotently:
#   RUNTIME=18 bash scripts/setup_runtime.sh     (or 15.4, 17.3; `make test-runtime RUNTIME=...` calls this)
# ${VENV:-.venv-dbr$RUNTIME} with requirements-dbr$RUNTIME.txt (that runtime's library versions, each with its
# source) and dtlab, DeepSpeed with its C++ ops and, where the runtime has it (15.4 only), Horovod (each built
# once, cached as wheels next to the main stack's), and a Jupyter kernel named python3. The requirements file's
# first lines say which Python, DeepSpeed and Horovod the runtime has ("# python: 3.11", ...).
#   then  .venv-dbr15.4/bin/dtlab course run ... / .venv-dbr15.4/bin/python -m pytest
# (not `VENV=.venv-dbr15.4 make ...`: make's setup target would install the main stack into it).
# A second run installs and builds nothing. No GPU, no CUDA toolkit needed.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNTIME=${RUNTIME:-18}
REQUIREMENTS=requirements-dbr$RUNTIME.txt
VENV=${VENV:-.venv-dbr$RUNTIME}
say() { printf '[runtime] %s\n' "$*"; }
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
start=$SECONDS

if [ ! -f "$REQUIREMENTS" ]; then
  known=""
  for f in requirements-dbr*.txt; do f=${f#requirements-dbr}; known="$known ${f%.txt}"; done
  say "no $REQUIREMENTS. Fix: RUNTIME= one of:$known"
  exit 2
fi
# field NAME: the value of the requirements file's "# NAME: value" line.
field() { sed -n "s/^# $1: *\([^ ]*\).*/\1/p" "$REQUIREMENTS" | head -1; }
PY_VERSION=$(field python)
DEEPSPEED_VERSION=$(field deepspeed)
HOROVOD_VERSION=$(field horovod)      # "none" where the runtime has no Horovod (16.0 ML and later)
# The runtime's Python: python3.X on PATH, or pyenv's build of it when the pyenv shim does not offer it.
find_python() {
  local p
  for p in "${PYTHON:-}" "python$PY_VERSION" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PY_VERSION".*/bin/python"$PY_VERSION"; do
    if [ -n "$p" ] && "$p" -c 'import sys' >/dev/null 2>&1; then command -v "$p"; return 0; fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  if ! PYTHON=$(find_python) || ! "$PYTHON" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$PY_VERSION')"; then
    say "no Python $PY_VERSION here; Databricks Runtime $RUNTIME has Python $PY_VERSION. Fix: install it (pyenv install $PY_VERSION) or set PYTHON=/path/to/python$PY_VERSION"
    exit 1
  fi
  say "creating $VENV with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# Reinstall only when what we install from changed.
want=$(cat "$REQUIREMENTS" pyproject.toml | sha256sum | cut -c1-16)
stamp="$VENV/.dtlab-requirements"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing $REQUIREMENTS and dtlab into $VENV (6.4 GB with torch's CUDA libraries: about 1.5 minutes from uv's cache, longer the first time it downloads them)"
  t=$SECONDS
  pip_q install --upgrade pip
  install_requirements "$REQUIREMENTS"
  # Mosaic Streaming where the runtime has it, without the cloud clients it declares (the requirements file's note)
  MOSAIC_VERSION=$(field mosaicml-streaming)
  if [ -n "$MOSAIC_VERSION" ] && [ "$MOSAIC_VERSION" != none ]; then
    pip_q install --no-deps "mosaicml-streaming==$MOSAIC_VERSION"
  fi
  # (setuptools 68, the runtime's, warns about pyproject.toml support at every editable install)
  PYTHONWARNINGS=ignore pip_q install --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
  say "packages installed in $((SECONDS - t)) s"
else
  say "packages up to date ($VENV)"
fi

# DeepSpeed's CPU accelerator (0.14 and later; this machine has no GPU) counts its "devices" with `numactl
# --hardware` (the deepspeed launcher and ZeRO-3 call it); on a GPU node it uses CUDA and never does.
if ! command -v numactl >/dev/null; then
  say "installing numactl (Debian) for DeepSpeed 0.14's CPU accelerator"
  if ! { locked apt apt-get install -y -qq numactl >/dev/null 2>&1 || { locked apt apt-get update -qq >/dev/null 2>&1 &&
         locked apt apt-get install -y -qq numactl >/dev/null 2>&1; }; }; then
    say "could not install numactl (needs root and Debian's apt): the deepspeed launcher will fail on CPU"
  fi
fi

t=$SECONDS
if [ "$HOROVOD_VERSION" != none ]; then
  bash scripts/build_horovod.sh "$PY"
fi
bash scripts/build_deepspeed.sh "$PY" "$DEEPSPEED_VERSION"
say "horovod ($HOROVOD_VERSION) and deepspeed $DEEPSPEED_VERSION ready in $((SECONDS - t)) s"

if [ ! -f "$VENV/share/jupyter/kernels/python3/kernel.json" ]; then
  say "registering the Jupyter kernel 'python3' in $VENV"
  "$PY" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (dtlab, DBR $RUNTIME)" >/dev/null
fi
say "ready in $((SECONDS - start)) s"
