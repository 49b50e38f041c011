# asyncrl rollout service and sync agent (and `asyncrl nats`, `asyncrl config`): the project
# installed from its own pyproject on a slim Python, with the CPU build of torch (the rollout
# service tokenises and the sync agent coordinates; neither runs a model). Build from the
# repository root:  docker build -f docker/service.Dockerfile -t asyncrl/service:0.1.0 .
# compose.yaml builds it (`docker compose build`).

#
# Air-gapped builds (docs/deployment.md, "Building without a container registry"):
# - PYTHON_IMAGE: any Debian-based image with Python 3.11, venv and pip, e.g. the one
#   docker/local-base.sh builds from Debian packages;
# - docker/local/ca-certificates/*.crt: extra CA certificates trusted while building (a
#   TLS-inspecting proxy's), so pip reaches the package registries;
# - docker/local/wheels/*.whl: wheels pip takes before the registries; a torch wheel of
#   TORCH_VERSION there (the CPU build) is installed instead of the one from TORCH_INDEX.
# docker/build-local.sh fills docker/local/ from this machine and builds every image.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

FROM ${PYTHON_IMAGE} AS build
# The torch version of constraints/cpu.txt, from PyTorch's CPU wheel index: pip never
# pulls a multi-GB CUDA wheel into this image. Every other package comes from
# constraints/runtime.lock, each file checked against its hash; a local torch wheel
# (docker/local/wheels) against constraints/torch-cpu.lock's.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_FIND_LINKS=/opt/local/wheels
COPY docker/local/ /opt/local/
COPY constraints /src/constraints
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN if compgen -G "/opt/local/ca-certificates/*.crt" > /dev/null; then \
        cp /opt/local/ca-certificates/*.crt /usr/local/share/ca-certificates/ && update-ca-certificates; \
    fi \
    && python -m venv /opt/asyncrl \
    && if compgen -G "/opt/local/wheels/torch-${TORCH_VERSION}*.whl" > /dev/null; then \
        /opt/asyncrl/bin/pip install --no-deps --require-hashes -r /src/constraints/torch-cpu.lock; \
    else \
        /opt/asyncrl/bin/pip install --no-deps --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"; \
    fi \
    && /opt/asyncrl/bin/pip install --no-deps --require-hashes -r /src/constraints/runtime.lock
WORKDIR /src
COPY pyproject.toml README.md ./
COPY asyncrl ./asyncrl
COPY launcher ./launcher
COPY recipes ./recipes
COPY rollout_service ./rollout_service
COPY sync_agent ./sync_agent
COPY trainer_daemon ./trainer_daemon
COPY tools ./tools
COPY local_engine ./local_engine
RUN /opt/asyncrl/bin/pip install --no-deps --no-build-isolation . \
    && /opt/asyncrl/bin/pip check

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="asyncrl service" \
      org.opencontainers.image.description="asyncrl rollout service and sync agent" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 asyncrl \
    && useradd --system --uid 10001 --gid asyncrl --home-dir /var/lib/asyncrl --create-home asyncrl \
    && install -d -o asyncrl -g asyncrl -m 0700 /var/lib/asyncrl/engine-slots
# engine-slots: where compose.cluster.yaml's engine-cpu replicas lock their port slots (a new
# volume mounted there takes this directory's owner)
COPY --from=build /opt/asyncrl /opt/asyncrl
ENV PATH=/opt/asyncrl/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    ASYNCRL_CACHE_DIR=/var/lib/asyncrl/cache \
    ASYNCRL_HEALTH_URL=http://127.0.0.1:8000/health
WORKDIR /var/lib/asyncrl
USER 10001:10001
EXPOSE 8000 8100
# ASYNCRL_HEALTH_URL: 8000 for the rollout service, 8100 for the sync agent (compose sets it).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['ASYNCRL_HEALTH_URL'], timeout=4)"]
ENTRYPOINT ["asyncrl"]
CMD ["--help"]
