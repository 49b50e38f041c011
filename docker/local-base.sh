#!/usr/bin/env bash
# Build a Debian base image from Debian's packages, for machines that reach the package
# registries (a Debian mirror, PyPI) but no container registry.
#
#   docker/local-base.sh [TAG]          default TAG: asyncrl/debian-python:bookworm
#
# debootstrap makes a minimal bookworm root file system with Python 3.11 (Debian's), pip,
# venv, wget and CA certificates; the host's locally added CA certificates
# (/usr/local/share/ca-certificates/*.crt, e.g. a TLS-inspecting proxy's) are copied in and
# trusted, so that pip inside a build on this base reaches the registries the host reaches.
# `docker import` turns the tree into an image. The result stands in for
# python:3.11-slim-bookworm (the Dockerfiles' PYTHON_IMAGE build argument):
#
#   docker build --build-arg PYTHON_IMAGE=asyncrl/debian-python:bookworm ...
#
# Needs: root, debootstrap, a running Docker engine. Environment: DEBIAN_MIRROR (default:
# the first deb.debian.org-style URI of the host's apt sources, else deb.debian.org),
# DEBIAN_SUITE (bookworm). Takes 2-5 minutes; skipped when TAG already exists (FORCE=1
# rebuilds).
set -euo pipefail
TAG="${1:-asyncrl/debian-python:bookworm}"
SUITE="${DEBIAN_SUITE:-bookworm}"

if [ "${FORCE:-0}" != "1" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "[local-base] $TAG exists (FORCE=1 rebuilds)"
    exit 0
fi
for tool in debootstrap docker; do
    command -v "$tool" >/dev/null || { echo "[local-base] needs $tool (apt-get install debootstrap docker.io)" >&2; exit 2; }
done
if [ "$(id -u)" != "0" ]; then
    echo "[local-base] debootstrap needs root" >&2
    exit 2
fi

mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
    mirror="$(grep -h -o -E '^(URIs:|deb) +https?://[^ ]+/debian' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null \
        | head -n1 | awk '{print $2}' || true)"
fi
mirror="${mirror:-http://deb.debian.org/debian}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
echo "[local-base] debootstrap $SUITE from $mirror ..."
debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,wget,tini \
    "$SUITE" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }

# The host's locally added CAs, trusted inside the image too.
shopt -s nullglob
extra=(/usr/local/share/ca-certificates/*.crt)
if [ ${#extra[@]} -gt 0 ]; then
    mkdir -p "$root/usr/local/share/ca-certificates"
    cp "${extra[@]}" "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
    echo "[local-base] trusted ${#extra[@]} local CA certificate(s)"
fi
# Slim like the official images: no apt lists, docs or caches.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror $SUITE main
deb $mirror $SUITE-updates main
EOF

tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
    --change 'CMD ["python3"]' \
    - "$TAG" >/dev/null
echo "[local-base] built $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
