# The smelt_jax trainer for TPU pods (GKE node pools through xpk, or TPU VMs): Python 3.11, the pinned
# JAX stack plus libtpu, and this project installed from its wheel. Nothing else: no tests, notebooks,
# fits or data (runs read their data and write their checkpoints on gs://, docs/tpu-quickstart.md).
#
#   make image                    # builds and tags IMAGE (default smelt-jax:<git short sha>)
#   make image push-image IMAGE=REGION-docker.pkg.dev/PROJECT/smelt/smelt-jax:TAG
#   smelt sweep submit --suite smelt16 --backend xpk --image REGION-docker.pkg.dev/PROJECT/smelt/smelt-jax:TAG ...
#
# Versions: requirements/cpu.txt (the pins of the tested CPU stack) constrains whatever the wheel
# requires, so the image gets the same jax/flax/optax/orbax/... as the tests; requirements/tpu.txt
# adds libtpu, the TPU runtime that jax 0.10.2 loads.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- builder: the project as a wheel (package data included: setup.cfg [options.package_data]) -----
FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
COPY pyproject.toml setup.cfg README.md ./
COPY smelt_jax ./smelt_jax
COPY experiments ./experiments
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && python -c "import glob, zipfile; (w,) = glob.glob('/wheels/smelt_jax-*.whl'); \
names = set(zipfile.ZipFile(w).namelist()); \
need = ['experiments/layouts.json', 'smelt_jax/data/corpus_expected.json', 'smelt_jax/reference_data/README.md']; \
missing = [n for n in need if n not in names]; \
assert not missing, f'{w} lacks its package data: {missing}'; print(w, len(names), 'files')"

# --- runtime -------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG GIT_COMMIT=unknown
LABEL org.opencontainers.image.title="smelt-jax" \
      org.opencontainers.image.description="SMELT experiment suite (JAX) for TPU pods" \
      org.opencontainers.image.revision="${GIT_COMMIT}"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SMELT_GIT_COMMIT=${GIT_COMMIT} \
    SMELT_DATA_DIR=/work/data_cache
COPY requirements/cpu.txt requirements/tpu.txt /tmp/requirements/
COPY --from=builder /wheels /tmp/wheels
RUN python -m pip install -c /tmp/requirements/cpu.txt -r /tmp/requirements/tpu.txt /tmp/wheels/smelt_jax-*.whl \
 && python -m pip check \
 && rm -rf /tmp/requirements /tmp/wheels \
 && JAX_PLATFORMS=cpu smelt --help > /dev/null
WORKDIR /work
# The jobs (xpk, JobSet, tpu-vm) replace the entrypoint with their trainer command
# (`python -m smelt_jax train RUN_ID ...`); an interactive `docker run IMAGE ARGS` runs `smelt ARGS`.
ENTRYPOINT ["smelt"]
CMD ["--help"]
