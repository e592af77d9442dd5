# prefix-epp developer commands. `make test` and `make demo` work on a fresh machine with Python 3.11.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: all test lint typecheck unit demo bench protos peers clean

all: test

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,bench]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check extproc tests bench protos

typecheck: $(STAMP)
	$(VENV)/bin/mypy extproc tests bench protos

test: $(STAMP) lint typecheck peers
	$(VENV)/bin/pytest -q -p no:cacheprovider

unit: $(STAMP)
	$(VENV)/bin/pytest -q -m "not e2e"

demo: $(STAMP)
	$(PY) -m bench.demo

bench: $(STAMP)
	$(PY) -m bench.run

# Go binaries (kube-apiserver + etcd for the API tests, the Go endpoint picker for the benchmark),
# built from source once and cached outside the repository (bench/peers/README.md).
peers:
	bash bench/peers/build.sh kube >/dev/null
	bash bench/peers/build.sh gie-epp >/dev/null

protos: $(STAMP)
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV) .cache build *.egg-info .mypy_cache .ruff_cache .pytest_cache
