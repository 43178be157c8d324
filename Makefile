# The two commands of the README: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: setup browser demo test lint docs bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[mpi,dev,docs,lm]'
	$(BIN)/python -c "import mlx.core, ipyparallel, mlx_lm, mlx_nbdist"
	@touch $(STAMP)

setup: $(STAMP)

# What tests/test_browser.py needs: the `browser` extra (playwright, jupyterlab) and
# Debian's chromium (Playwright drives it with executable_path; it downloads nothing).
# chromium is installed with apt-get only when missing, as root, on Debian; anywhere
# else the browser test is skipped and says why.
BROWSER_STAMP := $(VENV)/.browser-stamp

$(BROWSER_STAMP): pyproject.toml $(STAMP)
	$(BIN)/python -m pip install -q -e '.[browser]'
	@touch $@

browser: $(BROWSER_STAMP)
	@if ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && [ -f /etc/debian_version ]; then \
	    echo "installing Debian's chromium for the browser test"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -q --no-install-recommends chromium \
	      || echo "could not install chromium: the browser test will be skipped"; \
	  else \
	    echo "chromium is missing (needs root on Debian to install): the browser test will be skipped"; \
	  fi; \
	fi

demo: setup
	$(BIN)/python -m mlx_nbdist.demo --notebook notebooks/02-tensor-parallelism.ipynb --out reports/demo

NB_EXECUTE ?= cache
docs: setup
	MLX_NBDIST_DOCS_EXECUTE=$(NB_EXECUTE) $(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html
	@echo "site: docs/_build/html/index.html"

test: setup browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

# Benchmarks: side-by-side ratios, written to docs/performance.md (several minutes).
bench: setup
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache reports docs/_build
