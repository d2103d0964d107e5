# make demo : every op vs its reference (and, on a GPU, the quick benchmark), then Qwen3.5 generation
#             through the engine and its audit (tiny built-in model: kernels, graph launches, HF parity)
# make test : the test suite (CPU: Triton interpreter; GPU: kernels on the device)
# Both first install into .venv: on a CPU machine torch is the CPU build (torch==2.13.0); on a
# CUDA machine the venv sees the system's CUDA torch and triton.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# Without a GPU the Triton interpreter runs the kernels (it must be set before triton is imported).
RUN_ENV := $(if $(HAS_GPU),,TRITON_INTERPRET=1)

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(if $(HAS_GPU),--system-site-packages) $(VENV)
	$(if $(HAS_GPU),,$(PY) -m pip install -q torch==2.13.0)
	$(PY) -m pip install -q "setuptools>=64"
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(RUN_ENV) $(PY) -m fuselm demo
	$(if $(HAS_GPU),$(PY) benchmarks/ops.py --quick)
	$(RUN_ENV) $(PY) -m fuselm generate
	$(RUN_ENV) $(PY) -m fuselm audit

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

bench: $(VENV)/.installed
	$(PY) benchmarks/ops.py

clean:
	rm -rf $(VENV) src/*.egg-info
