#!/usr/bin/env bash
# Build Horovod 0.28.1 (its last release) with PyTorch + Gloo, and install it into a venv.
#
# Horovod's sdist no longer builds as-is on current toolchains; two fixes are applied:
#   1. CMake >= 4 refuses the bundled gloo's old cmake_minimum_required:
#      CMAKE_POLICY_VERSION_MINIMUM=3.5 lets it configure.
#   2. torch >= 2.1 headers need C++17; the sdist asks for C++14: bump CMAKE_CXX_STANDARD to 17.
# The wheel is cached outside the repo, keyed by Python and torch version, so a second set-up
# (or a fresh clone on the same machine) installs it in seconds instead of building ~4 minutes.
#
# On a CUDA machine, build with NCCL instead:  HOROVOD_GPU_OPERATIONS=NCCL bash scripts/build_horovod.sh
# (needs the CUDA toolkit; Databricks Runtime 15.4 LTS ML ships Horovod prebuilt.)
set -euo pipefail
PY=${1:-.venv/bin/python}
VERSION=0.28.1
say() { printf '[horovod] %s\n' "$*"; }
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"

if "$PY" -c "import horovod, horovod.torch as h, sys; sys.exit(not (horovod.__version__ == '$VERSION' and h.gloo_built()))" 2>/dev/null; then
  say "horovod $VERSION with PyTorch + Gloo already installed"
  exit 0
fi

build() {  # $1: scratch folder; every step must succeed (set -e does not apply in here)
  local work=$1 src=$1/horovod-$VERSION
  pip_q download --no-deps --no-binary :all: "horovod==$VERSION" -d "$work" &&
  tar -xzf "$work/horovod-$VERSION.tar.gz" -C "$work" &&
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt" &&
  { grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
      || { echo "patch 2 did not apply: horovod/torch/CMakeLists.txt changed"; return 1; }; } &&
  PATH="$(dirname "$PY"):$PATH" \
  CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS=${MAKEFLAGS:--j2} \
    "$PY" -m pip wheel --disable-pip-version-check --no-deps --no-build-isolation "$src" -w "$work/dist"
}
install_cached_wheel horovod "$VERSION" "2-4" build
"$PY" -c "import horovod.torch as h; assert h.gloo_built(), 'horovod built without Gloo'"
say "installed horovod $VERSION (PyTorch + Gloo)"
