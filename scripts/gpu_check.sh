#!/usr/bin/env bash
# On a CUDA machine, one command: what the GPUs are, the GPU tests, and the course with its CI
# parameters (nccl, one process per GPU), each written to runs/gpu-check-<time>/ with a summary.
#
#   bash scripts/gpu_check.sh              # after `make setup` with a CUDA build of torch (README)
#   PY=/path/to/python bash scripts/gpu_check.sh
#
# Exit code: 0 all passed, 1 something failed (see summary.md), 3 no CUDA GPU visible.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-.venv/bin/python}
out="runs/gpu-check-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA GPU visible to $PY (torch.cuda.is_available() is False). Fix: run this on a GPU machine," \
       "with the CUDA build of torch installed before make setup (README: On a GPU machine)." >&2
  exit 3
fi
{ command -v nvidia-smi >/dev/null && nvidia-smi; "$PY" -m dtlab env; } > "$out/environment.txt" 2>&1

status=0
# The GPU-only tests, and the multi-process tests whose devices follow the plan.
"$PY" -m pytest -q -m gpu tests/test_environment.py tests/test_distributed.py tests/test_launch.py \
    tests/test_checkpoint.py tests/test_precision.py > "$out/gpu-tests.txt" 2>&1 || status=1
"$PY" -m pytest -q tests/test_environment.py tests/test_distributed.py tests/test_data_parallel.py \
    tests/test_zero.py > "$out/device-tests.txt" 2>&1 || status=1
# The course, as a learner on this machine runs it.
"$PY" -m dtlab course run --ci --runs "$out" -q > "$out/course.txt" 2>&1 || status=1

{
  echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  head -n 30 "$out/environment.txt"
  echo '```'
  echo
  echo "GPU tests: $(tail -n 1 "$out/gpu-tests.txt")"
  echo "device tests: $(tail -n 1 "$out/device-tests.txt")"
  echo
  cat "$out"/*/summary.md 2>/dev/null || tail -n 20 "$out/course.txt"
} > "$out/summary.md"
cat "$out/summary.md"
exit $status
