# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,experiments]'
	touch $(STAMP)

.PHONY: install test demo bench
install: $(STAMP)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m adasum.demo --workers 4

bench: $(STAMP)
	$(PY) benchmarks/bench_collective.py
