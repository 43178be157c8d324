# The two commands of the README: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: setup demo test lint docs bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[mpi,dev,docs]'
	$(BIN)/python -c "import mlx.core, ipyparallel, mlx_nbdist"
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/python -m mlx_nbdist.demo --notebook notebooks/02-tensor-parallelism.ipynb --out reports/demo

NB_EXECUTE ?= cache
docs: setup
	MLX_NBDIST_DOCS_EXECUTE=$(NB_EXECUTE) $(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html
	@echo "site: docs/_build/html/index.html"

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check mlx_nbdist tests bench

# Benchmarks: side-by-side ratios, written to docs/performance.md (several minutes).
bench: setup
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache reports docs/_build
