#!/usr/bin/env bash
# Build Horovod 0.28.1 (its last release) with PyTorch + Gloo, and install it into a venv.
#
# Horovod's sdist no longer builds as-is on current toolchains; fixes (and one speed-up) applied to the
# unpacked sdist:
#   1. CMake >= 4 refuses the bundled gloo's old cmake_minimum_required:
#      CMAKE_POLICY_VERSION_MINIMUM=3.5 lets it configure.
#   2. torch >= 2.1 headers need C++17; the sdist asks for C++14: bump CMAKE_CXX_STANDARD to 17.
#   3. Release instead of RelWithDebInfo (setup.py's default; both -O3): no debug information, which
#      took a fifth of the compile (224 s -> 179 s on 2 cores) and made the wheel 18.5 MB instead of 1.1 MB.
#   4. Only for a CUDA build of torch on a machine without a GPU and without GPU operations asked for
#      (Databricks Runtime 15.4's torch 2.3.1+cu121 in .venv-dbr15.4): Horovod sees torch's CUDA and
#      adds its CUDA code, which needs a CUDA toolkit ("Could NOT find CUDAToolkit" at add_cuda in
#      horovod/torch/CMakeLists.txt) and could not be used anyway. Build it for CPU tensors only, as it
#      builds against a CPU torch (cmake/Modules/FindPytorch.cmake reports no CUDA).
# The wheel is cached outside the repo, keyed by Python and torch version (plus -nccl / -nogpu for the
# variants), so a second set-up, or a fresh clone on the same machine, installs it in seconds.
#
# On a CUDA machine, build with NCCL instead:  HOROVOD_GPU_OPERATIONS=NCCL bash scripts/build_horovod.sh
# (needs the CUDA toolkit and NCCL; Databricks Runtime 15.4 LTS ML ships Horovod prebuilt.)
set -euo pipefail
PY=${1:-.venv/bin/python}
VERSION=0.28.1
say() { printf '[horovod] %s\n' "$*"; }
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"

case "${HOROVOD_GPU_OPERATIONS:-}" in
  "")   features="PyTorch + Gloo"; check="h.gloo_built()"; variant="" ;;
  NCCL) features="PyTorch + Gloo + NCCL"; check="h.gloo_built() and h.nccl_built()"; variant="-nccl" ;;
  *)    say "HOROVOD_GPU_OPERATIONS=$HOROVOD_GPU_OPERATIONS is not supported here (NCCL or unset)"; exit 1 ;;
esac

if "$PY" -c "import horovod, horovod.torch as h, sys
sys.exit(not (horovod.__version__ == '$VERSION' and $check))" 2>/dev/null; then
  say "horovod $VERSION with $features already installed"
  exit 0
fi

# Patch 4 applies to a CUDA build of torch without a GPU (and no GPU operations asked for).
cpu_only=0
if [ -z "$variant" ] && "$PY" -c "import torch, sys
sys.exit(not (torch.version.cuda and not torch.cuda.is_available()))" 2>/dev/null; then
  cpu_only=1 variant="-nogpu"
fi

build() {  # $1: scratch folder; every step must succeed (set -e does not apply in here)
  local work=$1 src=$1/horovod-$VERSION
  pip_q download --no-deps --no-binary :all: "horovod==$VERSION" -d "$work" &&
  tar -xzf "$work/horovod-$VERSION.tar.gz" -C "$work" &&
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt" &&
  { grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
      || { echo "patch 2 did not apply: horovod/torch/CMakeLists.txt changed"; return 1; }; } &&
  sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$src/setup.py" &&
  { grep -q "else 'Release'" "$src/setup.py" || { echo "patch 3 did not apply: setup.py changed"; return 1; }; } &&
  if [ "$cpu_only" = 1 ]; then
    sed -i 's/print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)/print(False)/' \
        "$src/cmake/Modules/FindPytorch.cmake" &&
    { ! grep -q 'torch.version.cuda is not None' "$src/cmake/Modules/FindPytorch.cmake" \
        || { echo "patch 4 did not apply: cmake/Modules/FindPytorch.cmake changed"; return 1; }; }
  fi &&
  PATH="$(dirname "$PY"):$PATH" \
  CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS=${MAKEFLAGS:--j2} \
    "$PY" -m pip wheel --disable-pip-version-check --no-deps --no-build-isolation "$src" -w "$work/dist"
}
install_cached_wheel horovod "$VERSION" "3-6" build "$variant"
"$PY" -c "import horovod.torch as h; assert $check, 'horovod built without $features'"
say "installed horovod $VERSION ($features)"
