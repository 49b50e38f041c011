# asyncrl trainer: the project installed from its own pyproject on the SGLang image the
# engines run (compose passes SGLANG_IMAGE), keeping that image's CUDA build of torch
# (the install takes constraints/runtime.lock, which has no torch, into a venv over the base's
# site-packages; the build fails if the venv's torch is not the base's). The trainer
# and the engines then carry the same torch and the same NCCL, which an NCCL weight-update
# group needs (a communicator refuses members whose NCCL versions differ; each sglang release
# pins an exact torch: 0.5.15-0.5.17 torch 2.11.0, 0.5.18-0.5.21 torch 2.13.0, 0.5.22-0.5.23 torch 2.14.1). Another base
# works if it has exactly the engines' torch build; the sync agent refuses a mismatch. The entry point is `asyncrl trainer`, which builds the
# torchrun command line from trainer.nnodes / node_rank / nproc_per_node / master_addr /
# master_port (compose passes NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT as
# ASYNCRL_TRAINER__*) and execs torchrun -m trainer_daemon.
# Build from the repository root:
#   docker build -f docker/trainer.Dockerfile -t asyncrl/trainer:0.1.0 .

ARG TRAINER_BASE_IMAGE=lmsysorg/sglang:v0.5.23

# Build stage: the only one that sees docker/local/ (build CA certificates, wheels) and pip's
# downloads. The project and constraints/runtime.lock's packages (each checked against its
# hash; torch is not in the lock) go into a venv that sees the base's site-packages, so the
# base's torch (and its NCCL) is the one the trainer imports: the build fails otherwise.
FROM ${TRAINER_BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY docker/local/ /opt/local/
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN if compgen -G "/opt/local/ca-certificates/*.crt" > /dev/null; then \
        cp /opt/local/ca-certificates/*.crt /usr/local/share/ca-certificates/ && update-ca-certificates; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY constraints ./constraints
COPY asyncrl ./asyncrl
COPY launcher ./launcher
COPY recipes ./recipes
COPY rollout_service ./rollout_service
COPY sync_agent ./sync_agent
COPY trainer_daemon ./trainer_daemon
COPY tools ./tools
COPY local_engine ./local_engine
RUN python3 -c "import torch; print(torch.__version__, torch.__file__)" > /tmp/torch-before \
    && python3 -m venv --system-site-packages /opt/asyncrl \
    && export PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_FIND_LINKS=/opt/local/wheels \
    && /opt/asyncrl/bin/pip install --no-deps --require-hashes -r constraints/runtime.lock \
    && /opt/asyncrl/bin/pip install --no-deps --no-build-isolation . \
    && /opt/asyncrl/bin/python -c "import torch; print(torch.__version__, torch.__file__)" | cmp - /tmp/torch-before

# The image: the base plus the venv, nothing else from the build stage.
FROM ${TRAINER_BASE_IMAGE}
LABEL org.opencontainers.image.title="asyncrl trainer" \
      org.opencontainers.image.description="asyncrl trainer daemon under torchrun (FSDP2, NCCL)" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/asyncrl /opt/asyncrl
ENV PATH=/opt/asyncrl/bin:$PATH \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 asyncrl \
    && useradd --system --uid 10001 --gid asyncrl --home-dir /var/lib/asyncrl --create-home asyncrl
ENV ASYNCRL_CACHE_DIR=/var/lib/asyncrl/cache
WORKDIR /var/lib/asyncrl
USER 10001:10001
EXPOSE 9400 29500 29600
# Rank 0 (node_rank 0) serves Prometheus on trainer.metrics_port; other nodes have no HTTP
# listener, so their check is that torchrun is alive.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; h = os.environ.get('ASYNCRL_TRAINER__METRICS_HOST', '0.0.0.0').replace('0.0.0.0', '127.0.0.1'); p = os.environ.get('ASYNCRL_TRAINER__METRICS_PORT', '9400'); os.environ.get('ASYNCRL_TRAINER__NODE_RANK', '0') != '0' or urllib.request.urlopen(f'http://{h}:{p}/metrics', timeout=4)"]
ENTRYPOINT ["asyncrl", "trainer"]
CMD ["/etc/asyncrl/run.toml"]
