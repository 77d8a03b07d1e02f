# The course's two commands:  make course  (run every notebook)   make test  (run the test suite).
# Both set up .venv first (idempotent; the first run builds Horovod and DeepSpeed ops, cached).
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export PYSPARK_PYTHON := $(abspath $(PY))
export SPARK_LOCAL_IP ?= 127.0.0.1

.PHONY: setup course test lint clean
setup:
	@bash scripts/setup.sh

course: setup
	$(VENV)/bin/dtlab course run $(NOTEBOOKS) $(PARAMS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs .pytest_cache .ruff_cache
