#!/usr/bin/env bash
# Build the prefix-epp image from the Dockerfile without Docker, as `make image` (and so
# `make test`) does on the project's machines:
#
#   1. podman and debootstrap are installed with apt-get when missing (`apt-get update` once
#      first). A machine without apt-get and without them fails here, loudly: the image test
#      cannot run there and must not pass silently.
#   2. A Python base image stands in for python:3.11-slim (which cannot be pulled here):
#      debootstrap makes a minimal Debian root file system with python3 and a virtual
#      environment /opt/venv (pip inside) first on PATH; it is cached as a tarball under
#      .cache/image/ and imported into podman's storage.
#   3. `podman build --isolation chroot` builds the Dockerfile on that base, with the machine's
#      CA bundle mounted so pip inside the build trusts the package index.
#
# Prints the image name on the last line of its output. Settings (environment): IMAGE (default
# localhost/prefix-epp:test-<hash of the checkout path>, so checkouts never share a tag),
# DEBIAN_MIRROR, DEBIAN_SUITE (bookworm: Python 3.11, the supported version).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$ROOT/.cache/image"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
checkout_hash="$(printf '%s' "$ROOT" | sha256sum | cut -c1-12)"
IMAGE="${IMAGE:-localhost/prefix-epp:test-${checkout_hash}}"
# The base's recipe; a change to it gives a new tarball and image name.
PACKAGES="python3,python3-venv,ca-certificates"
recipe_hash="$(printf '%s|%s|%s' "$SUITE" "$PACKAGES" "venv:/opt/venv" | sha256sum | cut -c1-12)"
BASE_TAR="$CACHE/python-base-${SUITE}-${recipe_hash}.tar"
BASE_IMAGE="localhost/prefix-epp-python-base:${SUITE}-${recipe_hash}"

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'build-image: %s\n' "$*" >&2; exit 1; }

# 1. tools
missing=()
for tool in podman debootstrap; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  command -v apt-get >/dev/null 2>&1 \
    || die "${missing[*]} missing and no apt-get to install them: install podman and debootstrap, then run again (the image build and its test cannot run without them)"
  log "installing ${missing[*]} with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman debootstrap >&2
fi

# 2. the Python base
if ! podman image exists "$BASE_IMAGE"; then
  if [[ ! -f "$BASE_TAR" ]]; then
    log "debootstrap ${SUITE} with ${PACKAGES} (cached as ${BASE_TAR#"$ROOT"/})"
    mkdir -p "$CACHE"
    work="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    nice -n 10 debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$work/rootfs" "$MIRROR" >&2
    chroot "$work/rootfs" /usr/bin/python3 -m venv /opt/venv
    chroot "$work/rootfs" /opt/venv/bin/pip --version >&2
    # No package caches or lists in the base.
    rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"* \
      "$work/rootfs/root/.cache"
    tar --numeric-owner -C "$work/rootfs" -cf "$BASE_TAR.partial" .
    mv "$BASE_TAR.partial" "$BASE_TAR"
    rm -rf "$work"
    trap - EXIT
  fi
  log "importing the base as ${BASE_IMAGE}"
  podman import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' "$BASE_TAR" "$BASE_IMAGE" >&2
fi

# 3. the image
log "podman build ${IMAGE}"
previous="$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
nice -n 10 podman build --isolation chroot --build-arg "PYTHON_IMAGE=${BASE_IMAGE}" \
  -v /etc/ssl/certs:/etc/ssl/certs:ro --tag "$IMAGE" "$ROOT" >&2
# The build of older sources lost its tag: remove it rather than let rebuilds pile up.
current="$(podman image inspect --format '{{.Id}}' "$IMAGE")"
if [[ -n "$previous" && "$previous" != "$current" ]]; then
  podman rmi "$previous" >/dev/null 2>&1 || true
fi
echo "$IMAGE"
