#!/usr/bin/env bash
# pytest in two phases, exiting as one pytest run over both would (the Makefile's test targets):
#
#   bash scripts/test_phases.sh PYTHON TWO_AT_A_TIME ONE_AT_A_TIME [PYTEST ARGS...]
#
# First the tests TWO_AT_A_TIME selects (a pytest -m expression), ${TEST_WORKERS:-2} at a time with
# pytest-xdist, each test file on one worker (its fixtures set up once); then those ONE_AT_A_TIME selects,
# one after another. Both phases run even when the first fails. TEST_WORKERS=0 runs both one at a time.
# Pick tests with paths or -k in the pytest arguments (a -m there would replace each phase's selection).
# After each phase it prints its wall time and the CPU the whole machine spent meanwhile (/proc/stat, Linux):
# how busy the phase kept the cores, which says whether it waits or computes.
set -uo pipefail
py=$1 two=$2 one=$3
shift 3

# busy_ticks: the machine's busy CPU time since boot, in clock ticks (all cores; 0 without /proc/stat).
busy_ticks() {
  if [ -r /proc/stat ]; then awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9; exit}' /proc/stat; else echo 0; fi
}

# report NAME START_SECONDS START_TICKS: one line with the phase's wall time, CPU time and share of the cores.
report() {
  local wall=$((SECONDS - $2)) ticks=$(( $(busy_ticks) - $3 )) hz cores
  hz=$(getconf CLK_TCK) cores=$(getconf _NPROCESSORS_ONLN)   # not nproc: it reads OMP_NUM_THREADS
  awk -v n="$1" -v w="$wall" -v t="$ticks" -v hz="$hz" -v c="$cores" 'BEGIN {
    cpu = t / hz; printf "[phases] %s: %d s, %.0f core-s busy (%.0f%% of %d cores)\n", n, w, cpu,
      (w > 0 ? 100 * cpu / (w * c) : 0), c }'
}

start=$SECONDS ticks=$(busy_ticks)
"$py" -m pytest -m "$two" -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
first=$?
report "two at a time" "$start" "$ticks"
start=$SECONDS ticks=$(busy_ticks)
"$py" -m pytest -m "$one" "$@"
second=$?
report "one at a time" "$start" "$ticks"
# pytest exits 5 when it selects nothing: fine for one phase (the arguments chose tests of the other).
if [ "$first" = 5 ] && [ "$second" = 5 ]; then exit 5; fi
for status in "$first" "$second"; do
  case $status in 0|5) ;; *) exit "$status" ;; esac
done
