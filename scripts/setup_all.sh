#!/usr/bin/env bash
# Set up the course's stack and the runtime stacks CI tests, all at the same time (`make setup-all`, CI's first
# step): one stack's downloads and unpacking (network and disk) overlap another's Horovod and DeepSpeed compiles
# (both cores), where one after another each waits for the last. Each set-up is the one `make test` and
# `make test-runtime RUNTIME=...` run themselves (idempotent: they then find everything ready); what they share
# is made under a lock (scripts/lib.sh: `locked`). Each one's output goes to a log, printed whole when it ends,
# so the lines of three set-ups do not interleave.
#   RUNTIMES="15.4 18" bash scripts/setup_all.sh     (the default: .ci/run's runtimes)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

RUNTIMES=${RUNTIMES:-15.4 18}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
start=$SECONDS
names=(course)
pids=()
bash scripts/setup.sh > "$logs/course.log" 2>&1 &
pids+=($!)
for runtime in $RUNTIMES; do
  RUNTIME=$runtime VENV=.venv-dbr$runtime bash scripts/setup_runtime.sh > "$logs/$runtime.log" 2>&1 &
  pids+=($!)
  names+=("$runtime")
done

failed=()
for i in "${!pids[@]}"; do
  name=${names[$i]}
  if ! wait "${pids[$i]}"; then
    failed+=("$name")
  fi
  sed "s/^/[$name] /" "$logs/$name.log"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "[setup-all] FAILED: ${failed[*]} (its lines above); the others are ready"
  exit 1
fi
echo "[setup-all] ${names[*]} ready in $((SECONDS - start)) s, set up at the same time"
