# One image for every role; its console scripts are the entrypoints: `ferry-api` (the default),
# `ferry-worker`, `ferry-status`, `ferry-tiny-model` (see docker-compose.yml and deploy/k8s/).
# Build arguments pick the accelerator: TORCH_INDEX_URL the torch build (cpu, cu128, ...), BASE_IMAGE and
# EXTRA_PACKAGES an Ascend image (a CANN base image, torch-npu).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRA_PACKAGES=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /app
# A C++ compiler for torch.compile: Inductor builds the CPU workers' compiled passes with it (COMPILE_MODEL); on a
# base image without apt-get they stay eager.
RUN if command -v apt-get > /dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*; fi
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX_URL}
# The dependencies in a layer of their own, read from pyproject.toml before any source is copied: editing the
# code rebuilds only the layers below.
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep=chr(10))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt ${EXTRA_PACKAGES} \
    && rm /tmp/requirements.txt
COPY README.md LICENSE ./
COPY common common
COPY api api
COPY worker worker
COPY server server
# The wheel holds worker/data/corpus.txt (package data), which ferry-tiny-model trains the tokenizer on.
RUN pip install --no-deps . && rm -rf build
# An unprivileged user owns /models (FERRY_HOME): a new volume mounted there takes this owner.
RUN useradd --uid 10001 --create-home ferry && mkdir -p /models && chown ferry /models
USER 10001
ENV FERRY_HOME=/models HOST=0.0.0.0 PORT=8080
EXPOSE 8080 9400
# The API pod's liveness (workers override it: docker-compose.yml checks their metrics port).
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ['PORT']}/v2/health/live\", timeout=3)"]
CMD ["ferry-api"]
