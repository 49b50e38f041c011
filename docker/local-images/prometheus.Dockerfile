# Stand-in for prom/prometheus where no container registry is reachable: Debian's prometheus
# package (bookworm: 2.42) on a Debian base (docker/local-base.sh). Entry point, user and
# paths as the official image: `prometheus --config.file=... --storage.tsdb.path=/prometheus`
# as nobody (65534). The configuration compose.yaml mounts (docker/prometheus/) is valid for
# 2.42 and 3.x alike. Built by docker/build-local.sh; compose.yaml takes it as PROMETHEUS_IMAGE.

ARG BASE_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="prometheus (asyncrl local build, Debian package)"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus && chown 65534:65534 /prometheus
WORKDIR /prometheus
USER 65534:65534
EXPOSE 9090
HEALTHCHECK --interval=15s --timeout=5s --retries=3 \
    CMD ["wget", "-q", "-O", "/dev/null", "http://127.0.0.1:9090/-/healthy"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
