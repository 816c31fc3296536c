#!/usr/bin/env bash
# Builds stand-ins for the compose stack's base images, python:3.11-slim, redis:7 and nginx:1.27, from Debian
# packages, for hosts that reach no container registry (air-gapped clusters, CI sandboxes).
# An image that is already present (pulled or built before) is kept. Needs root, debootstrap and a
# Debian mirror (DEBIAN_MIRROR, default deb.debian.org). Usage: bash deploy/airgap/base_images.sh
set -euo pipefail
cd "$(dirname "$0")"
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE=dockrl-debian:bookworm

have() { docker image inspect "$1" >/dev/null 2>&1; }
pulled() { timeout 60 docker pull -q "$1" >/dev/null 2>&1; }

IMAGES=(python:3.11-slim redis:7 nginx:1.27)
missing=()
for image in "${IMAGES[@]}"; do
    have "$image" || pulled "$image" || missing+=("$image")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "base images: ${IMAGES[*]} present"
    exit 0
fi

if ! have "$BASE"; then
    command -v debootstrap >/dev/null || { echo "debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    echo "base images: debootstrap bookworm from $MIRROR"
    debootstrap --variant=minbase bookworm "$root" "$MIRROR" >/dev/null
    # The same sources a container's apt-get will use.
    echo "deb $MIRROR bookworm main" > "$root/etc/apt/sources.list"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import - "$BASE" >/dev/null
fi
# Debian's python3 is 3.11 on bookworm, as in python:3.11-slim.
for image in "${missing[@]}"; do
    name=${image%%:*}
    docker build -q -t "$image" -f "$name.Dockerfile" . >/dev/null
done
echo "base images: built ${missing[*]} from Debian packages"
