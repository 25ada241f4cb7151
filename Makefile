# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,experiments,tensorboard,mlflow,wandb,lightning,accelerate,jax,docs]'
	touch $(STAMP)

.PHONY: install test demo bench
install: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m mkdocs build --strict --quiet --site-dir build/site
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

# sequential vs Horovod's linearly scaled mean vs Adasum, 16 simulated workers, the embedded digits
demo: $(STAMP)
	$(PY) -m adasum compare --methods sequential,mean-scaled,adasum --workers 16 --lr 0.05 --epochs 8 --seeds 0,1,2 --overwrite --out runs/demo

bench: $(STAMP)
	$(PY) benchmarks/bench_collective.py
