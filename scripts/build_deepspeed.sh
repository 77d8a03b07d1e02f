#!/usr/bin/env bash
# Install DeepSpeed with its C++ ops compiled in, so no lesson stalls on a JIT compile.
#   bash scripts/build_deepspeed.sh [PYTHON] [VERSION]    (VERSION, or $DEEPSPEED_VERSION; default 0.19.8,
#   the main stack's; .venv-dbr15.4 uses 0.14.4, see scripts/setup_runtime.sh)
#
# The PyPI package compiles its ops the first time they are used, in every new environment:
# the shared-memory communication op at init_distributed (~30-50 s on 2 cores) and cpu_adam for
# optimizer offload (~40-90 s). Built into the wheel here once (~3 minutes), cached outside the
# repo per Python/torch pair. DS_ENABLE_NINJA=1: without it setuptools compiles the ops' four C++ files
# one after another, one core idle (329 s measured for 0.19.8 on 2 cores); with ninja, MAX_JOBS at a
# time, the same compiler flags (189 s). On CPU, fused_adam (~90 s more to build) is left out: the course's
# configs run PyTorch's AdamW ("torch_adam": true, dtlab.ds_config's default), so no lesson loads it;
# a config that asks for DeepSpeed's own Adam without offload compiles it on first use.
# Without a GPU DeepSpeed picks its CPU accelerator, also with a CUDA build of torch
# (torch.cuda.is_available() is false), and builds the CPU versions of the ops.
# On a CUDA machine (nvcc present) the same script builds the CUDA fused_adam and cpu_adam
# (cached apart, under <python>-<torch>-cuda).
set -euo pipefail
PY=${1:-.venv/bin/python}
VERSION=${2:-${DEEPSPEED_VERSION:-0.19.8}}
say() { printf '[deepspeed] %s\n' "$*"; }
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"

if "$PY" -c "import torch; print(int(torch.cuda.is_available()))" | grep -q 1; then
  OPS="cpu_adam fused_adam"; flags="DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1"; variant="-cuda"
else
  OPS="cpu_adam deepspeed_shm_comm"; flags="DS_BUILD_CPU_ADAM=1 DS_BUILD_SHM_COMM=1"
  variant=""
fi
have_ops() {
  "$PY" - "$VERSION" "$OPS" >/dev/null 2>&1 <<'PY'
import sys
from deepspeed.git_version_info import installed_ops, version
sys.exit(not (version == sys.argv[1] and all(installed_ops.get(op) for op in sys.argv[2].split())))
PY
}
if have_ops; then
  say "deepspeed $VERSION with prebuilt ops ($OPS) already installed"
  exit 0
fi

build() {  # $1: scratch folder
  # shellcheck disable=SC2086  # $flags is a list of VAR=value words
  PATH="$(dirname "$PY"):$PATH" env DS_BUILD_OPS=0 $flags DS_ENABLE_NINJA=1 MAX_JOBS=${MAX_JOBS:-2} \
    "$PY" -m pip wheel --disable-pip-version-check --no-deps --no-build-isolation \
          --no-binary deepspeed --no-cache-dir "deepspeed==$VERSION" -w "$1/dist"
}
install_cached_wheel deepspeed "$VERSION" "4-5" build "$variant"
have_ops || { say "installed wheel lacks the ops $OPS"; exit 1; }
say "installed deepspeed $VERSION with prebuilt ops ($OPS)"
