# smelt_jax — `make help` lists the targets. Everything runs inside .venv, created on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TPU_STAMP := $(VENV)/.tpu-installed
export PYTHONHASHSEED := 0
# pytest-xdist workers of `make test` (the tests compile small programs: one compile keeps one core busy)
TEST_WORKERS ?= 2

.PHONY: help install install-tpu test test-integration test-slow demo bench lint fits notebooks compile-report clean

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

test: $(STAMP)  ## the fast test suite (installs what it needs)
	@$(MAKE) --no-print-directory $(TPU_STAMP) || true
	$(PY) -m pytest -q -m "not slow and not integration" -n $(TEST_WORKERS) --dist loadfile --timeout 120

test-integration: $(STAMP) $(TPU_STAMP)  ## real processes, races, packaging, quick start, multihost, TPU compiles
	$(PY) -m pytest -q -m "integration and not slow" -n $(TEST_WORKERS) --dist loadfile

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
	$(PY) -m smelt_jax.analysis.notebooks_runner notebooks

compile-report: $(STAMP) $(TPU_STAMP)  ## AOT-compile smelt16 for TPU slices; writes docs/parallelism.md and the pair costs of docs/tpu-quickstart.md
	$(PY) -m smelt_jax compile-report --out docs/parallelism.md --costs-out docs/tpu-quickstart.md $(if $(BUDGET),--time-budget $(BUDGET))

clean:  ## remove caches (keeps .venv)
	rm -rf .pytest_cache .ruff_cache build dist *.egg-info

# Container image (Dockerfile) for TPU pods: docker, else podman (or CONTAINER_TOOL=...). IMAGE_NAME is
# smelt_jax.sweep.base.IMAGE_NAME; pushed to the Artifact Registry repository of docs/tpu-quickstart.md:
#   make image push-image IMAGE=REGION-docker.pkg.dev/PROJECT/smelt/smelt-jax:TAG
# then `smelt sweep submit --suite SUITE --backend xpk --image <that IMAGE> ... --submit`.
.PHONY: image push-image
IMAGE_NAME := smelt-jax
GIT_SHA = $(or $(shell git rev-parse --short HEAD 2>/dev/null),dev)
IMAGE ?= $(IMAGE_NAME):$(GIT_SHA)
CONTAINER_TOOL ?= $(firstword $(foreach tool,docker podman,$(shell command -v $(tool) 2>/dev/null)))
container_check = $(if $(CONTAINER_TOOL),,$(error $(1): no container tool found: install docker or podman, or name one with CONTAINER_TOOL))$(if $(shell timeout 30 $(CONTAINER_TOOL) info >/dev/null 2>&1 && echo up),,$(error $(1): $(CONTAINER_TOOL) is installed but cannot reach its daemon ('$(CONTAINER_TOOL) info' fails): start it, or name another tool with CONTAINER_TOOL))

image:  ## build the container image IMAGE (default smelt-jax:<git short sha>; docs/tpu-quickstart.md)
	$(call container_check,make image)
	$(CONTAINER_TOOL) build --build-arg GIT_COMMIT=$(GIT_SHA) -t $(IMAGE) .
	@echo "built $(IMAGE); push with: make push-image IMAGE=$(if $(findstring /,$(IMAGE)),$(IMAGE),REGION-docker.pkg.dev/PROJECT/smelt/$(IMAGE_NAME):TAG)"

push-image:  ## push IMAGE to Artifact Registry (IMAGE=REGION-docker.pkg.dev/PROJECT/smelt/smelt-jax:TAG)
	$(call container_check,make push-image)
	$(if $(findstring /,$(IMAGE)),,$(error make push-image: IMAGE=$(IMAGE) is a local tag: set IMAGE=REGION-docker.pkg.dev/PROJECT/smelt/$(IMAGE_NAME):TAG with your values))
	$(if $(filter PROJECT REGION TAG,$(subst /, ,$(subst :, ,$(subst -docker.pkg.dev, ,$(IMAGE))))),$(error make push-image: IMAGE=$(IMAGE) still has placeholders (PROJECT, REGION, TAG): put in your values))
	@if [ "$(IMAGE)" != "$(IMAGE_NAME):$(GIT_SHA)" ] && ! $(CONTAINER_TOOL) image inspect $(IMAGE) >/dev/null 2>&1; then \
	  $(CONTAINER_TOOL) tag $(IMAGE_NAME):$(GIT_SHA) $(IMAGE); fi
	$(CONTAINER_TOOL) push $(IMAGE)
	@echo "pushed $(IMAGE); submit with: smelt sweep submit --suite SUITE --backend xpk --image $(IMAGE) ..."
