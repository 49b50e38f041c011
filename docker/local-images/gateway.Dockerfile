# Stand-in for nginxinc/nginx-unprivileged where no container registry is reachable: Debian's
# nginx package on a Debian base (docker/local-base.sh), run unprivileged like the official
# image: listens on 8080 as uid 101, pid and temporary files under /tmp, every file in
# /etc/nginx/conf.d/ included (compose.yaml mounts docker/gateway/default.conf there). Build context: docker/local-images/.
# Built by docker/build-local.sh; compose.yaml takes it as GATEWAY_IMAGE.

ARG BASE_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="nginx unprivileged (asyncrl local build, Debian package)"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends nginx \
    && rm -rf /var/lib/apt/lists/* /etc/nginx/sites-enabled /etc/nginx/conf.d/*
COPY nginx.conf /etc/nginx/nginx.conf
USER 101:101
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=5s --retries=3 \
    CMD ["wget", "-q", "-O", "/dev/null", "http://127.0.0.1:8080/gateway-health"]
ENTRYPOINT ["nginx"]
CMD ["-g", "daemon off;"]
