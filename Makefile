# Two commands set a fresh machine up: `make demo` and `make test`.  Both build .venv from
# scratch when it is missing or older than pyproject.toml.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest bench browser clean

$(STAMP): pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m agents.demo

test: $(STAMP) browser lint typecheck pytest

# The report's test opens demo-report.html in headless Chromium (Debian's package).  Installed
# when missing and we may (root); otherwise that one test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
	  || apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null; } \
	  || echo "note: could not install chromium; the report's browser test will skip"

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
	$(BIN)/python bench/prefetch.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
