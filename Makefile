# Chainswarm — the two commands: `make demo` (run the demo swarm) and `make test` (run the tests).
# Both build .venv on first use with scripts/bootstrap.sh and reuse it afterwards.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HIVEMIND_LOGLEVEL ?= WARNING
export PYTHONWARNINGS ?= ignore::FutureWarning

.PHONY: demo test venv bench clean

venv: $(VENV)/.chainswarm-stamp
$(VENV)/.chainswarm-stamp: requirements.txt requirements-dev.txt pyproject.toml scripts/bootstrap.sh
	@scripts/bootstrap.sh $(VENV)

demo: venv
	$(VENV)/bin/chainswarm demo

# setsid + timeout: a hung swarm test can never outlive the run or leave orphaned servers behind.
test: venv
	setsid --wait timeout -k 30 1500 $(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; fi; exit $$rc

bench: venv
	$(PY) -m experiments.bench_planner

clean:
	rm -rf $(VENV) .pytest_cache
