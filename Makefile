# `make demo` and `make test` set everything up on a fresh machine (see scripts/bootstrap.sh).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
JOBS   ?= 2

.PHONY: demo test lint format gpu-check clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) scripts/bootstrap.sh
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m dsv4_compressor demo

lint: $(STAMP)
	$(PY) -m ruff check src tests scripts
	$(PY) -m ruff format --check src tests scripts

test: lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(JOBS) --durations=15

format: $(STAMP)
	$(PY) -m ruff format src tests scripts
	$(PY) -m ruff check --fix src tests scripts

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis
