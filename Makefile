# Two entry points: `make run` (embedded stack with the demo model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
TORCH ?= torch==2.13.0

.PHONY: install run test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"   # first, so nothing pulls a multi-GB CUDA build
	$(PY) -m pip install -q -e ".[fellow,dev]"
	touch $@

run: install
	$(VENV)/bin/swarm up

test: install
	$(VENV)/bin/pytest -q -p no:cacheprovider -n 2 --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info
