# The two commands of the README: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
#: run once more with MLX_NBDIST_PORTABLE=1 (no /proc, /dev/shm, process_vm_readv: the
#: routes a Mac takes) after the main run of `make test`
PORTABLE_TESTS ?= tests/test_portable.py

.PHONY: setup setup-min browser demo test test-min lint docs bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[cpu,mpi,dev,docs,lm]'
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
	MLX_NBDIST_PORTABLE=1 $(BIN)/python -m pytest $(PORTABLE_TESTS)

# `make test-min`: the lowest declared versions (tests/min-constraints.txt) in a second
# venv, the project installed as a built wheel (not editable), and a smoke set
# (tests/smoke_min.py) run from a temporary folder outside the checkout, so that
# `import mlx_nbdist` is the installed wheel. The venv is rebuilt when pyproject.toml or
# the constraints change; the wheel is rebuilt and reinstalled when a source file does.
PYTHON_MIN ?= $(shell command -v python3.11 || echo python3.11)
MIN_VENV   := .venv-min
MIN_BIN    := $(MIN_VENV)/bin
MIN_STAMP  := $(MIN_VENV)/.installed-stamp
MIN_WHEEL_STAMP := $(MIN_VENV)/.wheel-stamp
WHEEL_DIR  := build/wheel
SOURCES    := $(shell find mlx_nbdist -name '*.py' -not -path '*/__pycache__/*') README.md MANIFEST.in

$(MIN_STAMP): pyproject.toml tests/min-constraints.txt
	rm -rf $(MIN_VENV) build/lib build/bdist.* $(WHEEL_DIR)
	$(PYTHON_MIN) -m venv $(MIN_VENV)
	$(MIN_BIN)/python -m pip install -q --upgrade pip
	$(MIN_BIN)/python -m pip wheel -q --no-deps . -w $(WHEEL_DIR)
	$(MIN_BIN)/python -m pip install -q -c tests/min-constraints.txt \
	  "$$(ls $(WHEEL_DIR)/mlx_nbdist-*.whl)[cpu,mpi,lm]" pytest
	@touch $@

$(MIN_WHEEL_STAMP): $(MIN_STAMP) $(SOURCES)
	rm -rf build/lib build/bdist.* $(WHEEL_DIR)
	$(MIN_BIN)/python -m pip wheel -q --no-deps . -w $(WHEEL_DIR)
	$(MIN_BIN)/python -m pip install -q --no-deps --force-reinstall $(WHEEL_DIR)/mlx_nbdist-*.whl
	@touch $@

setup-min: $(MIN_WHEEL_STAMP)

test-min: setup-min
	@d=$$(mktemp -d /tmp/mlxnb-min.XXXXXX) && \
	cp tests/smoke_min.py tests/min-constraints.txt "$$d"/ && \
	cd "$$d" && \
	MLX_NBDIST_CHECKOUT="$(CURDIR)" "$(abspath $(MIN_BIN))/python" smoke_min.py --versions && \
	MLX_NBDIST_CHECKOUT="$(CURDIR)" timeout 600 "$(abspath $(MIN_BIN))/python" -m pytest \
	  -q -p no:cacheprovider --rootdir "$$d" smoke_min.py; \
	rc=$$?; rm -rf "$$d"; exit $$rc

lint: setup
	$(BIN)/ruff check .

# Benchmarks: side-by-side ratios, written to docs/performance.md (several minutes).
bench: setup
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) $(MIN_VENV) build *.egg-info .pytest_cache reports docs/_build
