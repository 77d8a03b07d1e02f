#!/usr/bin/env bash
# Set up everything the course needs, idempotently: .venv with requirements.txt and dtlab,
# Horovod and DeepSpeed with its C++ ops (each built once, cached as wheels), a Jupyter kernel,
# and Debian's Chromium for the website's browser check.
# Called by `make setup`, and so by `make test` and `make site`.
# DTLAB_SETUP=core (make setup-core, and so make course and make lab): the packages and the kernel only; the first
# lesson that imports Horovod or DeepSpeed builds it (dtlab course run), or a full set-up does.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
say() { printf '[setup] %s\n' "$*"; }
# shellcheck source=scripts/lib.sh
source scripts/lib.sh
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
  install_requirements requirements.txt
  pip_q install --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
  say "packages installed in $((SECONDS - t)) s"
else
  say "packages up to date ($VENV)"
fi

# The course's kernel, "Python 3 (dtlab)": this venv's Python. ipykernel's wheel ships a kernel.json of its own
# ("Python 3 (ipykernel)", argv "python"), so the file's existence says nothing: its display name does.
register_kernel() {
  if ! grep -q '"Python 3 (dtlab)"' "$VENV/share/jupyter/kernels/python3/kernel.json" 2>/dev/null; then
    say "registering the Jupyter kernel 'Python 3 (dtlab)' in $VENV"
    "$PY" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (dtlab)" >/dev/null
  fi
}

if [ "${DTLAB_SETUP:-full}" = core ]; then
  register_kernel
  say "ready in $((SECONDS - start)) s (Horovod and DeepSpeed are built by the first lesson that needs one:" \
      "05, 06, 10, 21; make setup builds both now)"
  exit 0
fi

bash scripts/build_horovod.sh "$PY"
bash scripts/build_deepspeed.sh "$PY"

# Chromium for the website's browser check (make site, tests/test_website.py): Debian's package.
if [ ! -x "${DTLAB_CHROMIUM:-/usr/bin/chromium}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing Debian's chromium for the website's browser check (about 20 s)"
    t=$SECONDS
    locked apt env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    locked apt env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
    say "chromium installed in $((SECONDS - t)) s"
  else
    say "WARNING: no Chromium, and this user cannot apt-get it. The website's browser check will fail until" \
        "'sudo apt-get install chromium' (or DTLAB_CHROMIUM=/path/to/chromium)."
  fi
fi

register_kernel
say "ready in $((SECONDS - start)) s"
