#!/usr/bin/env bash
# pytest in two phases, exiting as one pytest run over both would (the Makefile's test targets):
#
#   bash scripts/test_phases.sh PYTHON TWO_AT_A_TIME ONE_AT_A_TIME [PYTEST ARGS...]
#
# First the tests TWO_AT_A_TIME selects (a pytest -m expression), ${TEST_WORKERS:-2} at a time with
# pytest-xdist, each test file on one worker (its fixtures set up once); then those ONE_AT_A_TIME selects,
# one after another. Both phases run even when the first fails. TEST_WORKERS=0 runs both one at a time.
# Pick tests with paths or -k in the pytest arguments (a -m there would replace each phase's selection).
set -uo pipefail
py=$1 two=$2 one=$3
shift 3
"$py" -m pytest -m "$two" -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
first=$?
"$py" -m pytest -m "$one" "$@"
second=$?
# pytest exits 5 when it selects nothing: fine for one phase (the arguments chose tests of the other).
if [ "$first" = 5 ] && [ "$second" = 5 ]; then exit 5; fi
for status in "$first" "$second"; do
  case $status in 0|5) ;; *) exit "$status" ;; esac
done
