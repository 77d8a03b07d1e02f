# The course's two commands:  make course  (run every notebook)   make test  (run the test suite).
# make site: the newest run as a website in site/.  make lab: the lessons in JupyterLab with the course's kernel.
# Each sets up .venv first (idempotent). make test builds Horovod and DeepSpeed's ops at once (cached); make course
# and make lab build neither until a lesson that imports one runs (notebooks 00-04 need neither).
# make test-runtime RUNTIME=18 (the default), RUNTIME=15.4 or RUNTIME=17.3: that Databricks Runtime LTS ML's stack in
# .venv-dbr<RUNTIME>, the notebooks whose second run belongs to it as simulated Databricks job tasks
# (tests/variants.py), and the fast tests marked `cluster` (code a cluster runs; the slow ones, multi-process and
# Spark runs, stay on the course's stack: CI's time). CI runs 18 and 15.4.
# make test-quick: the inner loop (no notebooks, nothing marked `slow`).
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export PYSPARK_PYTHON := $(abspath $(PY))
export SPARK_LOCAL_IP ?= 127.0.0.1
# Every local Spark JVM (lessons, tests, the simulated job's driver) with the client compiler only: a session's start
# costs 0.64x the CPU and 0.9x the wall time (benchmarks/spark_start.py), and their jobs are too short to miss the
# optimizing compiler (tests/test_delta.py and test_spark.py: 78 s against 96 s, 88 core-s against 150).
export SPARK_SUBMIT_OPTS ?= -XX:TieredStopAtLevel=1
# Python writes the bytecode of what it compiles even where the environment says not to (PYTHONDONTWRITEBYTECODE=1,
# common in containers): else pytest rewrites every test module again in each process (collecting make test-quick's
# tests: 14.1 s and 14.2 core-s with it set, 11.6 s and 11.6 core-s without, in a fresh clone).
export PYTHONDONTWRITEBYTECODE :=

RUNTIME ?= 18
RUNTIMES ?= 15.4 18
RUNTIME_VENV ?= .venv-dbr$(RUNTIME)
RPY := $(RUNTIME_VENV)/bin/python

.PHONY: setup setup-all setup-core setup-runtime course lab site test test-quick test-runtime mutants lint clean
setup:
	@bash scripts/setup.sh

# The packages and the kernel, without the Horovod and DeepSpeed builds: `dtlab course run` builds each (once,
# cached) before the first lesson that imports it.
setup-core:
	@DTLAB_SETUP=core bash scripts/setup.sh

course: setup-core
	$(VENV)/bin/dtlab course run $(NOTEBOOKS) $(PARAMS)

# The lessons in JupyterLab, with the course's kernel ("Python 3 (dtlab)": this venv). LAB_ARGS="--no-browser" on a
# remote machine (then open the printed URL through an SSH tunnel).
lab: setup-core
	$(VENV)/bin/jupyter lab --notebook-dir notebooks $(LAB_ARGS)

# The newest course run (RUN=runs/<timestamp> for another) as a website in site/, checked in headless
# Chromium; with no run yet, the course runs first with its CI parameters.
site: setup
	$(VENV)/bin/dtlab site $(RUN)

# The unit tests run two at a time: most of their time is spent waiting for processes, Spark, servers and a
# browser to start (one at a time they kept the 2 cores busy a quarter of the time: 375 s of CPU in 712 s).
# Then the notebooks, one at a time: their claims include timings a test running beside them would disturb;
# with them the tests marked `alone`, which need the machine to themselves (they read its loopback byte counter,
# which another test adds to, hold a wall-clock measurement to a formula, or run the set-up, which may reinstall
# the venv under the other tests).
# (scripts/test_phases.sh; TEST_WORKERS=0 runs everything one at a time.)
test: setup
	@bash scripts/test_phases.sh $(PY) "not notebook and not alone" "notebook or alone" --ignore=tests/runtime $(PYTEST_ARGS)

# The inner loop: unit tests without notebooks or slow ones (markers in pyproject.toml), under 3 minutes warm;
# two at a time like make test's first phase (2 min 15 s against 2 min 45 s one at a time; 4 at a time: 2 min 28 s).
test-quick: setup
	@bash scripts/test_phases.sh $(PY) "not notebook and not slow and not alone" "alone and not notebook and not slow" \
	  --ignore=tests/runtime -q $(PYTEST_ARGS)

setup-runtime:
	@RUNTIME=$(RUNTIME) VENV=$(RUNTIME_VENV) bash scripts/setup_runtime.sh

# The course's stack and the runtime stacks CI tests (RUNTIMES="15.4 18"), set up at the same time: one's
# downloads overlap another's compiles. CI's first step; make test and make test-runtime then find them ready.
setup-all:
	@RUNTIMES="$(RUNTIMES)" bash scripts/setup_all.sh

test-runtime: export PYSPARK_PYTHON := $(abspath $(RPY))
test-runtime: export DTLAB_TEST_RUNTIME := $(RUNTIME)
test-runtime: setup-runtime
	@bash scripts/test_phases.sh $(RPY) "cluster and not runtime and not alone and not slow" "runtime or (cluster and alone)" tests $(PYTEST_ARGS)

# Grade every mutant of the exercises' references: kill rates and survivors in markdown (EXERCISES=... for some).
mutants: setup-core
	$(PY) scripts/mutants.py $(EXERCISES)

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs site .pytest_cache .ruff_cache
