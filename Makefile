# Two commands for a fresh machine: `make demo` and `make test` (`make notebooks` re-runs the notebooks).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The local CPU build of torch is installed first, so the project's open range installs nothing more.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test notebooks fuzz lint bench zoo clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH_PIN)"
	touch $@

# ONNX Runtime is its CPU build here. An environment made when it was onnxruntime-gpu has that wheel, which
# fills the same `onnxruntime` module: it is removed first, so the CPU build installs whole.
CPU_ORT := if $(PY) -m pip show -q onnxruntime-gpu 2>/dev/null; then $(PY) -m pip uninstall -y onnxruntime-gpu onnxruntime; fi

$(VENV)/.installed: $(VENV)/.base pyproject.toml
	$(CPU_ORT)
	$(PY) -m pip install -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.base pyproject.toml
	$(CPU_ORT)
	$(PY) -m pip install -e '.[dev]'
	touch $@ $(VENV)/.installed

$(VENV)/.installed-notebooks: $(VENV)/.base pyproject.toml
	$(CPU_ORT)
	$(PY) -m pip install -e '.[notebooks]'
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# Runs every notebook in examples/notebooks/ in a fresh kernel and saves it with its outputs (5-20 minutes).
notebooks: $(VENV)/.installed-notebooks
	$(PY) examples/notebooks/execute.py

# Two workers, one per core (each computes on one thread: conftest.py); a file's tests stay on one worker,
# so its module-scoped fixtures are built once. A worker that dies (a test past its timeout) ends the run with
# that test named: pytest-xdist 3.8's loadfile scheduling can wait forever for a replacement worker.
test: $(VENV)/.installed-dev
	$(PY) -m pytest -q -n 2 --dist loadfile --max-worker-restart=0

# The differential fuzz suite at its long profile (250 programs per property; `make test` runs 12).
fuzz: $(VENV)/.installed-dev
	FXFORGE_FUZZ=long $(PY) -m pytest -q tests/fuzz

lint: $(VENV)/.installed-dev
	$(PY) -m ruff check fxforge tests benchmarks examples

# The benchmarks need dev and the bench extra (torchao: the int8 section's PT2E + Inductor peer).
$(VENV)/.installed-bench: $(VENV)/.installed-dev pyproject.toml
	$(PY) -m pip install -e '.[dev,bench]'
	touch $@

bench: $(VENV)/.installed-bench
	$(PY) -m benchmarks

# The model zoo (torchvision, timm) in an environment of its own: the registries' torchvision is a CUDA build
# whose compiled ops do not load with the CPU torch, and once installed it breaks `import transformers`, so it
# stays out of $(VENV). `make zoo` runs tests/zoo; `$(ZOO_VENV)/bin/python -m benchmarks --suite zoo` writes its table.
ZOO_VENV ?= .venv-zoo
ZOO_PY := $(ZOO_VENV)/bin/python

$(ZOO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(ZOO_VENV)
	$(ZOO_PY) -m pip install --upgrade pip
	$(ZOO_PY) -m pip install "$(TORCH_PIN)"
	$(ZOO_PY) -m pip install -e '.[dev]' "torchvision==0.28.*" timm
	touch $@

zoo: $(ZOO_VENV)/.installed
	$(ZOO_PY) -m pytest -q -p no:cacheprovider tests/zoo

clean:
	rm -rf $(VENV) $(ZOO_VENV) build *.egg-info
