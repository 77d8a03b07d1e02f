# The course's two commands:  make course  (run every notebook)   make test  (run the test suite).
# make site: the newest run as a website in site/.
# Both set up .venv first (idempotent; the first run builds Horovod and DeepSpeed ops, cached).
# make test-runtime: the learner's Databricks Runtime 15.4 LTS ML stack in .venv-dbr15.4, every notebook
# as a simulated Databricks job task, and the unit tests of code a cluster runs.
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export PYSPARK_PYTHON := $(abspath $(PY))
export SPARK_LOCAL_IP ?= 127.0.0.1

RUNTIME_VENV ?= .venv-dbr15.4
RPY := $(RUNTIME_VENV)/bin/python
# Unit tests of code that runs on a cluster, repeated on the runtime's library versions.
RUNTIME_UNIT_TESTS ?= tests/test_checkpoint.py tests/test_tracking.py tests/test_spark.py tests/test_launch.py \
	tests/test_distributed.py tests/test_notebook_widgets.py tests/test_clusters.py tests/test_environment.py \
	tests/test_data.py tests/test_ds_config.py tests/test_planner_formulas.py tests/test_planner_measured.py \
	tests/test_package.py tests/test_course.py tests/test_jobs.py \
	tests/test_compat.py tests/test_fsdp.py tests/test_sharded_checkpoint.py tests/test_benchmarks.py \
	tests/test_tensor_parallel.py tests/test_pipeline.py tests/test_context_parallel.py tests/test_expert_parallel.py \
	tests/test_composition.py

.PHONY: setup setup-runtime course site test test-runtime lint clean
setup:
	@bash scripts/setup.sh

course: setup
	$(VENV)/bin/dtlab course run $(NOTEBOOKS) $(PARAMS)

# The newest course run (RUN=runs/<timestamp> for another) as a website in site/, checked in headless
# Chromium; with no run yet, the course runs first with its CI parameters.
site: setup
	$(VENV)/bin/dtlab site $(RUN)

test: setup
	$(PY) -m pytest --ignore=tests/runtime $(PYTEST_ARGS)

setup-runtime:
	@bash scripts/setup_runtime.sh

test-runtime: export PYSPARK_PYTHON := $(abspath $(RPY))
test-runtime: setup-runtime
	$(RPY) -m pytest tests/runtime $(RUNTIME_UNIT_TESTS) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs site .pytest_cache .ruff_cache
