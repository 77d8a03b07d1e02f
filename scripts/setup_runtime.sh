#!/usr/bin/env bash
# Set up Databricks Runtime 15.4 LTS ML's Python stack as a second test target, idempotently:
# ${VENV:-.venv-dbr15.4} with requirements-dbr15.4.txt (torch 2.3.1, MLflow 2.13.1, PySpark 3.5.0,
# numpy 1.23.5, pandas 1.5.3, ...) and dtlab, Horovod 0.28.1 and DeepSpeed 0.14.4 with its C++ ops
# (each built once, cached as wheels next to the main stack's), a Jupyter kernel named python3.
#   bash scripts/setup_runtime.sh   then  .venv-dbr15.4/bin/dtlab course run ... / .venv-dbr15.4/bin/python -m pytest
# (not `VENV=.venv-dbr15.4 make ...`: make's setup target would install the main stack into it).
# A second run installs and builds nothing. Needs Python 3.11 (the runtime's); no GPU, no CUDA toolkit.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-dbr15.4}
REQUIREMENTS=requirements-dbr15.4.txt
# The runtime's DeepSpeed version is not in any source found; 0.14.4 is the last release before the
# runtime's build (0.14.5 came out three days before its Aug 19, 2024 release) and supports torch 2.3.
DEEPSPEED_VERSION=0.14.4
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
say() { printf '[runtime] %s\n' "$*"; }
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
start=$SECONDS

if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    say "$PYTHON is $("$PYTHON" --version 2>&1); Databricks Runtime 15.4 has Python 3.11: set PYTHON=python3.11"
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
  say "installing $REQUIREMENTS and dtlab into $VENV (first time: about 4 minutes, 6.4 GB with torch's CUDA libraries)"
  t=$SECONDS
  pip_q install --upgrade pip
  install_requirements "$REQUIREMENTS"
  # (setuptools 68, the runtime's, warns about pyproject.toml support at every editable install)
  PYTHONWARNINGS=ignore pip_q install --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
  say "packages installed in $((SECONDS - t)) s"
else
  say "packages up to date ($VENV)"
fi

# DeepSpeed 0.14's CPU accelerator (this machine has no GPU) counts its "devices" with `numactl
# --hardware` (the deepspeed launcher and ZeRO-3 call it); on a GPU node it uses CUDA and never does.
if ! command -v numactl >/dev/null; then
  say "installing numactl (Debian) for DeepSpeed 0.14's CPU accelerator"
  if ! { apt-get install -y -qq numactl >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 &&
         apt-get install -y -qq numactl >/dev/null 2>&1; }; }; then
    say "could not install numactl (needs root and Debian's apt): the deepspeed launcher will fail on CPU"
  fi
fi

t=$SECONDS
bash scripts/build_horovod.sh "$PY"
bash scripts/build_deepspeed.sh "$PY" "$DEEPSPEED_VERSION"
say "horovod and deepspeed ready in $((SECONDS - t)) s"

if [ ! -f "$VENV/share/jupyter/kernels/python3/kernel.json" ]; then
  say "registering the Jupyter kernel 'python3' in $VENV"
  "$PY" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (dtlab, DBR 15.4)" >/dev/null
fi
say "ready in $((SECONDS - start)) s"
