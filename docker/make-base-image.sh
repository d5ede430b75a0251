#!/usr/bin/env bash
# Build a Python 3.11 base image from Debian packages, for machines that cannot pull python:3.11-slim.
#
#   docker/make-base-image.sh [TAG]          (default TAG: ntk-base:bookworm-py311)
#
# Debian bookworm's python3 is 3.11; the image holds python3, python3-venv, python3-pip and the CA certificates
# of the machine that builds it (so pip inside `docker build` trusts the same TLS roots as the host, e.g. a
# proxy's CA). The root filesystem is made once with debootstrap and cached as a tarball under
# $NTK_DOCKER_CACHE (default /var/tmp/ntk-docker); later runs only `docker import` it.
# Needs root, debootstrap, and a Docker engine reachable through the docker CLI (DOCKER_HOST honored).
# Env: DEBIAN_MIRROR (default: the first URI of the host's apt sources, else http://deb.debian.org/debian),
#      HOST_CA_BUNDLE (default /etc/ssl/certs/ca-certificates.crt).
set -euo pipefail

tag="${1:-ntk-base:bookworm-py311}"
cache="${NTK_DOCKER_CACHE:-/var/tmp/ntk-docker}"
tarball="$cache/base-bookworm-py311.tar"
ca_bundle="${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

log() { printf '[make-base-image] %s\n' "$*" >&2; }

if docker image inspect "$tag" >/dev/null 2>&1; then
    log "image $tag already present"
    exit 0
fi

default_mirror() {
    local uri
    uri="$(grep -hoE '^(URIs:|deb) +(\[[^]]*\] +)?https?://[^ ]+/debian/?( |$)' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
        | grep -oE 'https?://[^ ]+' | head -n 1 || true)"
    printf '%s' "${uri:-http://deb.debian.org/debian}"
}

if [[ ! -s "$tarball" ]]; then
    mirror="${DEBIAN_MIRROR:-$(default_mirror)}"
    rootfs="$cache/rootfs.$$"
    mkdir -p "$cache"
    trap 'rm -rf "$rootfs"' EXIT
    log "debootstrap bookworm from $mirror into $rootfs (a few minutes, once)"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 \
        || { tail -n 30 "$cache/debootstrap.log" >&2; exit 1; }
    if [[ -s "$ca_bundle" ]]; then
        # The host's bundle already contains Debian's roots plus any local ones.
        cp "$ca_bundle" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    fi
    # Slim it like the official images: no apt lists, caches, docs or man pages.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/tmp/*
    tar --numeric-owner -C "$rootfs" -cf "$tarball.part" .
    mv "$tarball.part" "$tarball"
    rm -rf "$rootfs"
    trap - EXIT
    log "cached root filesystem: $tarball ($(du -h "$tarball" | cut -f1))"
fi

docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$tarball" "$tag" >/dev/null
log "imported $tag"
