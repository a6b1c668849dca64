# One image for every role; its console scripts are the entrypoints: `ferry-api` (the default),
# `ferry-worker`, `ferry-status`, `ferry-tiny-model` (see docker-compose.yml).
# Build arguments pick the accelerator: TORCH_INDEX_URL the torch build (cpu, cu128, ...), BASE_IMAGE and
# EXTRA_PACKAGES an Ascend image (a CANN base image, torch-npu).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRA_PACKAGES=""
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL}
COPY pyproject.toml README.md ./
COPY api api
COPY worker worker
COPY common common
RUN pip install --no-cache-dir . ${EXTRA_PACKAGES}
ENV FERRY_HOME=/models HOST=0.0.0.0 PORT=8080
EXPOSE 8080 9400
CMD ["ferry-api"]
