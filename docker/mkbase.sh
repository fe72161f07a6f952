#!/usr/bin/env bash
# Make the CPU image's base without a registry: a minimal Debian root file system from Debian's mirror, with
# python3 and python3-venv, as a tarball for `hpkit image import-base` (Docker/podman `import`).
#
#   docker/mkbase.sh OUT.tar [RELEASE]
#
# The build host's CA bundle replaces the image's, so that pip inside builds trusts the same (possibly
# intercepting) HTTPS proxy the host does. Needs root (or mmdebstrap's unshare mode) and mmdebstrap.
set -euo pipefail

out=${1:?usage: $0 OUT.tar [RELEASE]}
release=${2:-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ca_bundle=${HPKIT_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

command -v mmdebstrap >/dev/null || {
  echo "mmdebstrap is not installed: apt-get install --no-install-recommends mmdebstrap" >&2
  exit 1
}
[ -r "$ca_bundle" ] || {
  echo "no CA bundle at $ca_bundle: set HPKIT_CA_BUNDLE" >&2
  exit 1
}

mkdir -p "$(dirname "$out")"
tmp="$out.partial.$$.tar"
trap 'rm -f "$tmp"' EXIT
# Documentation, man pages and locales are dead weight in a training image.
mmdebstrap --quiet --format=tar --variant=minbase --include=python3,python3-venv,ca-certificates \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
  --customize-hook="upload $ca_bundle /etc/ssl/certs/ca-certificates.crt" \
  "$release" "$tmp" "$mirror"
mv "$tmp" "$out"
trap - EXIT
echo "wrote $out"
