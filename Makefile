# smelt_jax — `make help` lists the targets. Everything runs inside .venv, created on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TPU_STAMP := $(VENV)/.tpu-installed
export PYTHONHASHSEED := 0

.PHONY: help install install-tpu test test-slow demo bench lint fits notebooks compile-report clean

help:  ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

$(STAMP): setup.cfg requirements/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

install: $(STAMP)  ## create .venv with the pinned CPU stack and the package (editable)

# The TPU compiler (libtpu, ~1.3 GB) for ahead-of-time compilation of TPU programs on this CPU.
# A failed install is reported, not fatal: the TPU tests then skip and say why.
$(TPU_STAMP): $(STAMP) requirements/tpu.txt
	$(PY) -m pip install -q -r requirements/tpu.txt && touch $@ \
	  || echo "make: libtpu could not be installed; TPU compilation tests will skip"

install-tpu: $(TPU_STAMP)  ## add libtpu (TPU ahead-of-time compilation on CPU)

test: $(STAMP)  ## the test suite (fast tests; installs what it needs)
	@$(MAKE) --no-print-directory $(TPU_STAMP) || true
	$(PY) -m pytest -q

test-slow: $(STAMP) $(TPU_STAMP)  ## the slow tests only
	$(PY) -m pytest -q -m slow

demo: $(STAMP)  ## the main job on CPU with bundled data
	$(PY) -m smelt_jax demo

bench: $(STAMP)  ## benchmarks (medians, side by side); tables in benchmarks/README.md
	$(PY) -m benchmarks.run

lint: $(STAMP)  ## ruff
	$(VENV)/bin/ruff check .

fits: $(STAMP)  ## regenerate every fit, table and figure under fits/
	$(PY) -m smelt_jax fits-all

notebooks: $(STAMP)  ## execute every notebook on the committed results
	$(PY) -m smelt_jax.notebooks_runner notebooks

compile-report: $(STAMP) $(TPU_STAMP)  ## AOT-compile smelt16 for TPU slices; writes docs/parallelism.md
	$(PY) -m smelt_jax compile-report --out docs/parallelism.md $(if $(BUDGET),--time-budget $(BUDGET))

clean:  ## remove caches (keeps .venv)
	rm -rf .pytest_cache .ruff_cache build dist *.egg-info
