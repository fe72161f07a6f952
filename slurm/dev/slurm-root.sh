#!/usr/bin/env bash
# Build (once) and print the path of a Debian trixie root file system holding Slurm 24.11 and munge, from
# which slurm/dev/up.sh runs a SLURM=24.11 cluster (HyperPod's Slurm) on a Debian 12 host. Packages come from
# Debian's registry only: the mirror named in the host's apt sources (DEBIAN_MIRROR overrides it).
#
#   HPKIT_SLURM_ROOT  where the root lives (default: ${XDG_CACHE_HOME:-$HOME/.cache}/hpkit/slurm-24.11-trixie-r3)
#
# Built once per machine and shared by every cluster (the tests' too): concurrent callers wait on a lock, and a
# root appears only when complete (built beside it, then renamed). Besides Slurm, the root holds the libraries
# that the host's Python and its extension modules link against (libffi8 for ctypes and torch, ...), so that
# a job step runs the host venv's python inside it, and runc, which runs Slurm's OCI containers (oci.conf).
# Needs root and mmdebstrap.
set -euo pipefail

# The default path names the root's revision: a root with other packages is built beside an older one, never over
# it (clusters running from the older one keep their files). r2: runc, for Slurm's OCI containers. r3: slurmdbd
# (ACCOUNTING=1 clusters; it talks to the host's MariaDB over TCP on the loopback).
root=${HPKIT_SLURM_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/hpkit/slurm-24.11-trixie-r3}
release=trixie
# The marker the command wrappers look for: inside the root, run Slurm's binaries directly.
marker=etc/hpkit-slurm-root
packages=slurm-wlm,slurm-client,munge,libffi8,libssl3t64,zlib1g,libbz2-1.0,liblzma5,libsqlite3-0,libreadline8t64,libncursesw6,libuuid1,libexpat1,libgdbm6t64,libmpdec4,procps,runc,slurmdbd

die() { echo "slurm-root: $*" >&2; exit 1; }

if [[ -e $root/$marker ]]; then
  echo "$root"
  exit 0
fi
command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed: apt-get install --no-install-recommends mmdebstrap (make system-deps SLURM=24.11)"
[[ $(id -u) == 0 ]] || die "run as root: the root is built with mmdebstrap's root mode"

mirror=${DEBIAN_MIRROR:-}
if [[ -z $mirror ]]; then
  # The host's own Debian mirror: deb822 (URIs:) or one-line sources (deb URI suite ...).
  mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
    awk '/^URIs:/ && /debian\/?$/ && !/security/ {print $2; exit}')
  [[ -n $mirror ]] || mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
    awk '$1 == "deb" && $2 ~ /debian\/?$/ && $2 !~ /security/ {print $2; exit}')
  mirror=${mirror:-http://deb.debian.org/debian}
fi

mkdir -p "$(dirname "$root")"
exec 9>"$root.lock"
flock 9
if [[ -e $root/$marker ]]; then  # built by another caller while this one waited
  echo "$root"
  exit 0
fi
tmp=$root.partial.$$
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
echo "slurm-root: building Slurm 24.11 ($release) in $root from $mirror" >&2
# shellcheck disable=SC2016  # mmdebstrap's hooks get the root as $1
mmdebstrap --quiet --variant=apt --include="$packages" \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --customize-hook='mkdir -p "$1/work"' \
  --customize-hook="echo 'Slurm 24.11 root of hpkit (slurm/dev/slurm-root.sh)' >\"\$1/$marker\"" \
  "$release" "$tmp" "$mirror" >&2
rm -rf "$root"
mv "$tmp" "$root"
trap - EXIT
echo "slurm-root: built in $(($(date +%s) - start)) s ($(du -sh "$root" | cut -f1))" >&2
echo "$root"
