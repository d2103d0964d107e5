# make demo : every op vs its reference (and, on a GPU, the quick benchmark), then Qwen3.5 text
#             generation and chat from a tiny random-weight checkpoint with the real tokenizer, and the
#             engine's audit (tiny built-in model: kernels, graph launches, HF parity)
# make test : the test suite (CPU: Triton interpreter; GPU: kernels on the device)
# make checkpoint-9b DIR=... : a random-weight checkpoint of the 9B config (~19 GB, bf16) in DIR
# Both first install into .venv: on a CPU machine torch is the CPU build (torch==2.13.0); on a
# CUDA machine the venv sees the system's CUDA torch and triton.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# Without a GPU the Triton interpreter runs the kernels (it must be set before triton is imported).
RUN_ENV := $(if $(HAS_GPU),,TRITON_INTERPRET=1)

# The demo's checkpoint: written once, reused by later runs.
DEMO_CHECKPOINT := $(VENV)/demo-checkpoint

.PHONY: demo test bench checkpoint-9b clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(if $(HAS_GPU),--system-site-packages) $(VENV)
	$(if $(HAS_GPU),,$(PY) -m pip install -q torch==2.13.0)
	$(PY) -m pip install -q "setuptools>=64"
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(RUN_ENV) $(PY) -m fuselm demo
	$(if $(HAS_GPU),$(PY) benchmarks/ops.py --quick)
	# Random weights: the text below is gibberish, as expected; the tokenizer, chat template,
	# checkpoint loading, engine and streaming are the real ones.
	test -f $(DEMO_CHECKPOINT)/tokenizer.json || \
		$(RUN_ENV) $(PY) -m fuselm init-checkpoint $(DEMO_CHECKPOINT) --config tiny
	$(RUN_ENV) $(PY) -m fuselm generate $(DEMO_CHECKPOINT) --prompt "The capital of France is" --max-tokens 12
	printf 'Hello!\n' | $(RUN_ENV) $(PY) -m fuselm chat $(DEMO_CHECKPOINT) --max-tokens 12
	$(RUN_ENV) $(PY) -m fuselm audit

# Without a GPU the suite runs on every core, at most 4 (pytest-xdist, a test file a worker; the cap
# keeps a container that reports its host's cores from starting dozens of torch processes): the
# interpreter's kernels are single-threaded, so two cores take ~11 minutes where one took ~20.
test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=15 $(if $(HAS_GPU),,-n auto --maxprocesses 4 --dist loadfile) tests

bench: $(VENV)/.installed
	$(PY) benchmarks/ops.py

checkpoint-9b: $(VENV)/.installed
	$(if $(DIR),,$(error usage: make checkpoint-9b DIR=path/to/new-checkpoint))
	$(RUN_ENV) $(PY) -m fuselm init-checkpoint $(DIR) --config 9b

clean:
	rm -rf $(VENV) src/*.egg-info
