# syntax=docker/dockerfile:1
# exitplan container images, one Dockerfile, three targets:
#
#   operator    `exitplan operator` (kopf + the planner) on a slim Python image      -> .[operator]
#   worker      routers, split workers and profiling Jobs on a CUDA 13 + cuDNN 9
#               runtime with onnxruntime-gpu (it falls back to its CPU provider
#               on nodes without a GPU)                                               -> .[worker,operator]
#   worker-cpu  the same data plane on the slim Python image (CPU pools, kind)        -> .[worker,operator]
#
# The data-plane images also carry the operator extra: a profiling Job's last step is
# `exitplan operator publish-profile` in the same image (operator/builders.py build_profile_job).
#
#   docker build --target operator   -t exitplan-operator:0.1.0 .
#   docker build --target worker     -t exitplan-worker:0.1.0 .
#   docker build --target worker-cpu -t exitplan-worker-cpu:0.1.0 .
#
# Supply chain: everything an image is made of is pinned, and each kind of pin is renewed by one command.
#   Base images  The *_IMAGE build ARGs below are IMAGE:TAG@sha256:DIGEST when pinned: Docker pulls the
#                digest, the tag is there for people. `make pin-images` (tools/pin_images.py) asks the
#                registries (Docker Hub, nvcr.io) which digest each tag names now and rewrites the ARGs. To
#                move to a new tag (a Python patch release, a CUDA release), edit the TAG in the ARG and run
#                it again; an ARG without @sha256:... is not pinned yet. `python3 tools/pin_images.py
#                --check` changes nothing and exits 1 when a pin is missing or the tag has moved.
#   Packages     requirements/<image>.lock pins every Python package the image gets, transitive ones, pip
#                and setuptools included, with the sha256 hashes of their files (CPython 3.11, linux x86_64);
#                it is installed with `pip install --require-hashes --no-deps`, then the exitplan wheel with
#                `--no-deps`, so pip fetches nothing the lock does not name and `pip check` proves the set
#                complete. `make lock` regenerates the locks after a change to pyproject.toml (the direct
#                pins) or requirements/tools.in (pip, setuptools); `make lock-upgrade` also moves the
#                transitive pins to their newest releases.

ARG PYTHON_IMAGE=python:3.11.15-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu22.04

# ---------------------------------------------------------------- the exitplan wheel
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY requirements/tools.lock /tmp/requirements/
RUN pip install --no-cache-dir --require-hashes --no-deps -r /tmp/requirements/tools.lock
COPY pyproject.toml README.md ./
COPY exitplan/ exitplan/
COPY api/ api/
COPY planner/ planner/
COPY operator/ operator/
COPY worker_image/ worker_image/
COPY prepare/ prepare/
COPY client/ client/
COPY localrun/ localrun/
COPY devcluster/ devcluster/
COPY storage/ storage/
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

# ---------------------------------------------------------------- slim images (operator, worker-cpu)
FROM ${PYTHON_IMAGE} AS slim-base
RUN groupadd --system --gid 10001 exitplan \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin exitplan
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

FROM slim-base AS operator-venv
ARG EXITPLAN_VERSION=0.1.0
COPY requirements/operator.lock /tmp/requirements/
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --require-hashes --no-deps -r /tmp/requirements/operator.lock \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps "/wheels/exitplan-${EXITPLAN_VERSION}-py3-none-any.whl[operator]" \
 && /opt/venv/bin/pip check

FROM slim-base AS worker-cpu-venv
ARG EXITPLAN_VERSION=0.1.0
COPY requirements/worker.lock /tmp/requirements/
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --require-hashes --no-deps -r /tmp/requirements/worker.lock \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps "/wheels/exitplan-${EXITPLAN_VERSION}-py3-none-any.whl[worker,operator]" \
 && /opt/venv/bin/pip check

FROM slim-base AS operator
COPY --from=operator-venv /opt/venv /opt/venv
USER 10001:10001
EXPOSE 9464
ENTRYPOINT ["exitplan"]
CMD ["operator"]

FROM slim-base AS worker-cpu
COPY --from=worker-cpu-venv /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["exitplan"]
CMD ["--help"]

# ---------------------------------------------------------------- CUDA image (worker)
FROM ${CUDA_IMAGE} AS cuda-base
ENV DEBIAN_FRONTEND=noninteractive
# Ubuntu 22.04 ships Python 3.11 (the project needs 3.11); the archive replaces patch versions
# with security fixes, so the packages are not pinned to one.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 exitplan \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin exitplan
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

FROM cuda-base AS worker-venv
ARG EXITPLAN_VERSION=0.1.0
COPY requirements/worker.lock /tmp/requirements/
COPY --from=wheel /wheels /wheels
RUN python3.11 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --require-hashes --no-deps -r /tmp/requirements/worker.lock \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps "/wheels/exitplan-${EXITPLAN_VERSION}-py3-none-any.whl[worker,operator]" \
 && /opt/venv/bin/pip check

FROM cuda-base AS worker
COPY --from=worker-venv /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["exitplan"]
CMD ["--help"]
