# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The local CPU build of torch is installed first, so the project's open range installs nothing more.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test fuzz lint bench clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH_PIN)"
	touch $@

$(VENV)/.installed: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.base pyproject.toml
	$(PY) -m pip install -e '.[dev]'
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q

# The differential fuzz suite at its long profile (250 programs per property; `make test` runs 12).
fuzz: $(VENV)/.installed-dev
	FXFORGE_FUZZ=long $(PY) -m pytest -q tests/fuzz

lint: $(VENV)/.installed-dev
	$(PY) -m ruff check fxforge tests benchmarks examples

bench: $(VENV)/.installed-dev
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
